"""Many-row int8/int4 products in 8-bit integers (kernels/qgemm.c, built and loaded by
`tierlm.infer.native`): what a prefill's quantised linear layers run on where the CPU has
AVX2 or AVX512-VNNI (quant.QLinear.integer_rows)."""
from __future__ import annotations

import torch

from . import native

X_GROUPS = (128, 64, 32)  # inputs of x per 8-bit scale against int8 weights, the first that divides K


def x_group(k: int) -> int | None:
    """The group of inputs each 8-bit scale of x covers in `product` against int8 weights of k
    inputs (None: no group divides k)."""
    return next((g for g in X_GROUPS if k % g == 0), None)


def fast() -> bool:
    """Whether many-row quantised products run on the integer units here (kernels/qgemm.c's AVX2
    or AVX512-VNNI path: the active `native.isa()` is avx2 or higher); elsewhere its portable loop
    is the reference the fast paths are tested against, slower than a dequantised fp32 product."""
    lib = native.library()
    return lib is not None and bool(lib.tierlm_qgemm_fast())


def product(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int = 0) -> torch.Tensor:
    """x [..., K] @ W^T in 8-bit integers for many rows (kernels/qgemm.c): each row of x rounded to
    8 bits a group (of `x_group(K)` inputs against int8 weights, of the weights' `group`
    against int4), integer sums per group, fp32 after. int8: qweight [N, K], scales [N] (one per
    output row); int4 (`group`): qweight [N, K/2] in our nibble order, scales the fp32 (scale, lo)
    pairs [N, K/group, 2]. Returns fp32 [rows, N]."""
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if group else 1)
    xg = group or x_group(k)
    if xg is None or xg % 32 or k % xg:
        raise ValueError(f"qgemm: no group of 8-bit x fits {k} inputs (group {group})")
    xf = native._rows(x, k)
    w = qweight.contiguous()
    s = scales if scales.dtype == torch.float32 and scales.is_contiguous() else scales.float().contiguous()
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)
    rc = native.library().tierlm_qgemm(xf.data_ptr(), xf.shape[0], k, w.data_ptr(), s.data_ptr(), n, group, xg,
                                       y.data_ptr(), n, torch.get_num_threads())
    native._check(rc, xf.shape[0], k, group)
    return y
