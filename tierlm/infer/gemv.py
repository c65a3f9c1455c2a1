"""One-row products on the matrix-vector kernel.

Decoding one sequence multiplies every weight by a single row. For bf16 weights, `F.linear` at
M=1 goes through the matrix-matrix path and reads the weights at 2.7-6.8 GB/s here, while
`torch.mv` on the same tensors streams them at 9.8 GB/s on one thread and 13.6-18 GB/s on two
(benchmarks/infer_gemv.py measures it): decode is bound by bytes read, so that kernel is the
decode speed. Several rows (prefill, batched decode) keep `F.linear`, which is the faster one there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GemvLinear(nn.Linear):
    """nn.Linear whose single-row products use torch.mv (same weights, same module state)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.numel() != x.shape[-1] or w.dtype != torch.bfloat16:
            return F.linear(x, w, self.bias)
        y = torch.mv(w, x.reshape(-1).to(w.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], w.shape[0])


def use_gemv(model: nn.Module) -> int:
    """Route every plain nn.Linear of `model` through GemvLinear; returns how many. The class is
    swapped in place, so parameters, hooks and the loader's installed tensors are untouched."""
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = GemvLinear
            n += 1
    return n
