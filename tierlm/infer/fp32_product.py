"""Many-row products in fp32 of weights kept in a lighter format (bf16 on a CPU without bf16 matrix
instructions, int4 without our integer kernels): one matrix at a time converted into a kept fp32
buffer, then multiplied.

The buffer is kept between calls: a fresh one a matrix made the kernel zero and fault in new pages
for each product (4.4 GB for each prefill forward of a 1.1B model), and at 16 rows that cost more
than the product itself (a 5632 x 2048 bf16 weight on the 2-vCPU AMD EPYC without AVX-512, 2
threads: 51 ms converted fresh against 12 ms into the kept buffer). `plan.inference.scratch_bytes`
counts the largest matrix.

The product runs on oneDNN's inner product where PyTorch has it on an x86 CPU
(`torch.ops.mkldnn._linear_pointwise`, what PyTorch's compiler calls for a linear layer): on that
EPYC it multiplies fp32 at ~124 GFLOP/s where `F.linear` (MKL) reaches ~97, and its own
workspace is a few MiB of panels, not a copy of the weight. Which one runs follows the CPU's
architecture and PyTorch's build, never a timing, so the same command gives the same bits on the
same machine; either is deterministic from call to call.
"""
from __future__ import annotations

import functools
import platform
import threading

import torch
import torch.nn.functional as F

_kept = threading.local()


def scratch(numel: int) -> torch.Tensor:
    """fp32 room for one converted matrix, kept between calls (one per thread that multiplies)."""
    buf = getattr(_kept, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _kept.buf = None  # the old one goes before the new one is made
        buf = _kept.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


@functools.lru_cache(maxsize=1)
def onednn_linear() -> bool:
    """Whether fp32 products run on oneDNN: an x86 CPU and a PyTorch built with it."""
    return (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def product(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [rows, K] fp32 @ w [N, K] fp32 ^T (+ bias), fp32 [rows, N], on a CPU."""
    if onednn_linear():
        return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), w, bias, "none", [], "")
    return F.linear(x2, w, bias)


def upcast_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K] ^T (+ bias) with w (any float dtype) converted to fp32 into the kept
    buffer and x to fp32; the result in x's dtype."""
    wf = scratch(w.numel()).view(w.shape)
    wf.copy_(w)
    y = product(x.reshape(-1, x.shape[-1]).float(), wf, None if bias is None else bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
