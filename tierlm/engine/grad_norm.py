"""A gradient's 2-norm in fp32 without an fp32 copy of the whole gradient.

`torch.linalg.vector_norm(g, dtype=torch.float32)` on a bf16 gradient upcasts all of it first: for
TinyLlama's head (65.5M elements) a 250 MiB transient on the optimizer's thread (50-260 ms of it),
which took a bf16 run under --cpu-mem 4GiB ~60 MiB past its budget (docs/benchmarks.md, genoa-2c). A gradient of more than CHUNK elements is reduced in CHUNK-element
pieces, then the pieces' norms. Up to CHUNK (every tensor of the tests' models) the bits are those
of torch's `clip_grad_norm_` on an fp32 copy. Beyond it they differ, and are closer to the exact
norm: torch's one fp32 reduction over 65.5M bf16 values of unit size gave 8054.2 where the exact
norm is 8095.4 and the pieces give 8095.7 (a clip coefficient moves by as much).
"""
from __future__ import annotations

import torch

CHUNK = 1 << 20  # elements: a 4 MiB fp32 transient


def grad_norm(g: torch.Tensor) -> torch.Tensor:
    """The fp32 2-norm of `g` (any float dtype)."""
    if g.dtype == torch.float32 or g.numel() <= CHUNK:
        return torch.linalg.vector_norm(g, 2, dtype=torch.float32)
    flat = g.reshape(-1)
    buf = torch.empty(CHUNK, dtype=torch.float32)  # one, reused: fresh pages per piece cost 2x the time
    parts = []
    for i in range(0, flat.numel(), CHUNK):
        piece = flat[i:i + CHUNK]
        b = buf[:piece.numel()]
        b.copy_(piece)
        parts.append(torch.linalg.vector_norm(b, 2))
    return torch.linalg.vector_norm(torch.stack(parts), 2)
