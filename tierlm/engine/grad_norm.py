"""A gradient's 2-norm in fp32 without an fp32 copy of the whole gradient.

`torch.linalg.vector_norm(g, dtype=torch.float32)` on a bf16 gradient upcasts all of it first: for
TinyLlama's head (65.5M elements) a 250 MiB transient on the optimizer's thread (50-260 ms of it),
which took a bf16 run under --cpu-mem 4GiB ~60 MiB past its budget (docs/benchmarks.md at a2b1c1e, a 2-vCPU Zen 4 VM). A gradient of more than CHUNK elements is reduced in CHUNK-element
pieces, then the pieces' norms. Up to CHUNK (every tensor of the tests' models) the bits are those
of torch's `clip_grad_norm_` on an fp32 copy. Beyond it they differ, and are closer to the exact
norm: torch's one fp32 reduction over 65.5M bf16 values of unit size gave 8054.2 where the exact
norm is 8095.4 and the pieces give 8095.7 (a clip coefficient moves by as much).
"""
from __future__ import annotations

import threading

import torch

CHUNK = 1 << 20  # elements: a 4 MiB fp32 buffer per thread that takes norms
_local = threading.local()


def _buffer() -> torch.Tensor:
    """This thread's CHUNK-element fp32 buffer, kept across calls. A buffer per call is fresh pages
    for every gradient (tierlm's malloc settings return them on free), zeroed by the kernel: 6.1 ms
    a call for a Qwen2.5-0.5B MLP gradient on a 2-vCPU Zen 4 VM, 0.8 ms with this buffer; 72 such calls a
    step, on the compute's thread (docs/benchmarks.md at a2b1c1e, "The step is the drive's time for its
    requests")."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = torch.empty(CHUNK, dtype=torch.float32)
    return buf


def chunked(g: torch.Tensor) -> bool:
    """Is `g`'s norm taken in pieces (and can pieces of it be taken ahead, `piece_norms`)?"""
    return g.dtype != torch.float32 and g.numel() > CHUNK


def piece_norms(g: torch.Tensor, final) -> dict[int, torch.Tensor]:
    """The norms of the pieces of a chunked `g` whose every element lies in one of the `final`
    (start, end) element ranges: what grad_norm computes for them, taken before the rest of `g`
    is (a tied head's rows that no token looks up are final at the start of backward). Only for
    a `chunked` gradient: any other's norm is one reduction."""
    flat = g.reshape(-1)
    out = {}
    for i in range(0, flat.numel(), CHUNK):
        j = min(i + CHUNK, flat.numel())
        if any(a <= i and j <= b for a, b in final):
            out[i // CHUNK] = _piece(flat[i:j], _buffer())
    return out


def _piece(piece: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    b = buf[:piece.numel()]
    b.copy_(piece)
    return torch.linalg.vector_norm(b, 2)


def grad_norm(g: torch.Tensor, known: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """The fp32 2-norm of `g` (any float dtype). known: norms of pieces taken ahead (piece_norms)."""
    if not chunked(g):
        return torch.linalg.vector_norm(g, 2, dtype=torch.float32)
    flat = g.reshape(-1)
    buf = _buffer()
    known = known or {}
    parts = [known[i // CHUNK] if i // CHUNK in known else _piece(flat[i:i + CHUNK], buf)
             for i in range(0, flat.numel(), CHUNK)]
    return torch.linalg.vector_norm(torch.stack(parts), 2)
