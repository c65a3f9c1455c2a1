"""One-row products on the matrix-vector kernel.

Decoding one sequence multiplies every weight by a single row. For bf16 weights, `F.linear` at
M=1 goes through the matrix-matrix path and reads the weights at 2.7-6.8 GB/s here, while
`torch.mv` on the same tensors streams them at 9.8 GB/s on one thread and 13.6-18 GB/s on two
(benchmarks/infer_gemv.py measures it): decode is bound by bytes read, so that kernel is the
decode speed. Several rows (prefill, batched decode) keep `F.linear`, which is the faster one there,
except on a CPU without bf16 matrix instructions (AVX2 only): there a bf16 product of many rows runs
on a fallback kernel far slower than fp32, so from UPCAST_MIN_ROWS rows the weight is converted to
fp32 for that product (`fp32_product`: into a kept buffer, then oneDNN's fp32 product;
`benchmarks/infer_gemv.py`, a 5632 x 2048 weight at 64 rows on a 2-vCPU AMD EPYC: 142.6 ms in bf16
against 65.8 ms converted fresh on one thread, 70.0 against 39.2 on two; at 8 rows the conversion
lost, 19 against 142 ms in a loaded moment, hence the threshold).

Where our own kernel builds (`tierlm.infer.native`), one row runs on it rather than `torch.mv`, and
so do 2..15 rows on those CPUs: it reads each bf16 weight row once for up to four rows of x
(benchmarks/infer_gemv.py on the EPYC, 2 threads: one row 17.4 GB/s against `mv`'s 14.2, eight rows
6.2 against `F.linear`'s 2.4).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..plan.inference import UPCAST_MIN_ROWS
from ..precision import cpu_has_bf16_matmul
from . import fp32_product, native

# UPCAST_MIN_ROWS (16): converting the weight cost about as much as 13 bf16 rows on the fallback kernel


@functools.lru_cache(maxsize=1)
def bf16_matmul_is_slow() -> bool:
    """Whether this CPU lacks bf16 matrix instructions (`tierlm.precision.cpu_bf16_isa`, the
    predicate `--precision auto` trains by). Which arithmetic a product uses (fp32 conversion, our
    kernel or F.linear) follows it, so it is read from the ISA flags, never timed: the same command
    gives the same tokens on the same machine."""
    return not cpu_has_bf16_matmul()


class GemvLinear(nn.Linear):
    """nn.Linear whose single-row products use torch.mv (same weights, same module state), and
    whose many-row bf16 products run in fp32 where this CPU has no fast bf16 kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) as GemvLinear computes it: one bf16 row on the matrix-vector kernel, many
    bf16 rows in fp32 where this CPU has no fast bf16 kernel."""
    if w.dtype != torch.bfloat16:
        return F.linear(x, w, bias)
    rows = x.numel() // x.shape[-1]
    cpu = w.device.type == "cpu"
    if rows >= UPCAST_MIN_ROWS and cpu and bf16_matmul_is_slow():
        return fp32_product.upcast_linear(x, w, bias)
    if cpu and (rows == 1 or bf16_matmul_is_slow()) and native.available() and w.is_contiguous():
        y = native.gemv_bf16(x, w)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
    if rows != 1:
        return F.linear(x, w, bias)
    y = torch.mv(w, x.reshape(-1).to(w.dtype))
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], w.shape[0])


def use_gemv(model: nn.Module) -> int:
    """Route every plain nn.Linear of `model` through GemvLinear; returns how many. The class is
    swapped in place, so parameters, hooks and the loader's installed tensors are untouched.

    A subclass without a bias is swapped too: a family's own Linear that only changes how the
    product is written (Falcon's `input @ weight.T`, which exists to round before a bias) computes
    the same map, and ran on torch's many-row kernel at one row (a Falcon-shaped model decoded at
    38% of memory bandwidth). One that computes something else is caught by the inference engine's
    check at load (generic.check swaps the tiny copy's modules the same way)."""
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear or (isinstance(mod, nn.Linear) and not isinstance(mod, GemvLinear)
                                      and mod.bias is None and _plain_init(type(mod))):
            mod.__class__ = GemvLinear
            n += 1
    return n


def _plain_init(cls) -> bool:
    """A subclass that adds no parameters or submodules of its own (its __init__ is nn.Linear's)."""
    return cls.__init__ is nn.Linear.__init__
