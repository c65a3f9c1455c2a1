"""Tolerances for our products (kernels/gemv.c, layer.c) derived from their formats and K, not
measured on one machine: each kernel path (portable, AVX2, AVX-512) sums in its own order and the
tests must pass on all of them.

U is fp32's unit roundoff. A sum of K terms in fp32, in any order, errs by at most (K - 1) U of the
sum of the terms' magnitudes; rounding errors of opposite signs cancel, and the probabilistic bound
(Higham and Mary, SIAM J. Sci. Comput. 2019) is LAMBDA sqrt(K) U of that sum, failing with
probability below 2 exp(-LAMBDA^2 / 2) (1e-8 for 6) per output. A few more roundings after the sum
(an int8 row's scale, an int4 group's scale times x's, the lo term) add EXTRA U.
"""
import torch

U = 2.0 ** -24
LAMBDA = 6.0
EXTRA = 4

# One step of x rounded by a kernel (the distance between neighbouring rounded values), as a
# fraction of the largest |x| it is scaled by: 8 bits a group (int4, and int8's light one-row x):
# 1/127; 16 bits a row (int8 one row): 1/32767; bf16 (bf16's light one-row x), of x itself: one
# bf16 unit, 2^-7 of |x| at most (8 significant bits).
STEP = {"x8": 1 / 127, "x16": 1 / 32767, "bf16": 2.0 ** -7}


def fp32_sum_tol(k: int, magnitude: torch.Tensor) -> torch.Tensor:
    """The largest error of K fp32 products summed in any order (and a few roundings after),
    elementwise, given `magnitude` = the sum of the terms' magnitudes (|x| @ |w|^T)."""
    return (LAMBDA * k ** 0.5 + EXTRA) * U * magnitude


def check_products(got: torch.Tensor, ref: torch.Tensor, k: int, magnitude: torch.Tensor) -> None:
    """got (a kernel's fp32 products of K terms) against ref (float64 of the same rounded inputs),
    elementwise within fp32_sum_tol; `magnitude` is |x| @ |w|^T of those terms."""
    err = (got.double() - ref.double()).abs()
    tol = fp32_sum_tol(k, magnitude.double())
    worst = (err / tol).max().item()
    assert worst <= 1, f"products err {worst:.3g}x the fp32 bound for K={k}"


def x_step(kind: str, x: torch.Tensor, group: int = 0, light: bool = False, isa: str = "avx2") -> float:
    """The largest step of the kernels' rounding of x [rows, K] before a product (kernels/gemv.c,
    tl_prepare_x), as an absolute value of x; 0 where x is taken in fp32 (or to 2^-17, the bf16
    split). int4: 8 bits a group of a multiple of 64, else 16 bits a row; int8 at one row: 8 bits
    a group of 128 with light x on avx512vnni and up (K a multiple of 128), else 16 bits a row;
    bf16 at one row: x rounded to bf16 with light x on avx512bf16."""
    from tierlm.infer.native import ISAS
    rows, k = x.shape
    top = x.abs().max().item()
    if kind == "int4":
        if group % 64 == 0:
            return x.view(rows, -1, group).abs().amax(-1).max().item() * STEP["x8"]
        return top * STEP["x16"]
    if kind == "int8" and rows == 1:
        if light and ISAS.index(isa) >= ISAS.index("avx512vnni") and k % 128 == 0:
            return x.view(1, -1, 128).abs().amax(-1).max().item() * STEP["x8"]
        return top * STEP["x16"]
    if kind == "bf16" and rows == 1 and light and isa in ("avx512bf16", "amx"):  # amx: bf16 rows as avx512bf16
        return top * STEP["bf16"]
    return 0.0


# Steps of a kernel's rounding of x allowed between two computations of nearly the same x (the
# same input normalised in C and in torch, say): an input lands one step away where it was within
# a few ulp of a rounding boundary, a chance of a few ulp against a step (2^-24 * 127 for 8 bits,
# 2^-16 for bf16) per input, so two in one comparison are already rare.
FLIPS = 2


def check_rounded(got: torch.Tensor, ref: torch.Tensor, k: int, magnitude: torch.Tensor, step: float,
                  w_max: float) -> None:
    """got against ref, both from x rounded by the kernel (step: tolerances.x_step) from inputs
    that differ by fp32 rounding: fp32 sums of K terms whose magnitudes sum to `magnitude`, twice
    (both sides sum), and FLIPS inputs a step apart times the largest |w|."""
    err = (got.double() - ref.double()).abs()
    tol = 2 * fp32_sum_tol(k, magnitude.double()) + FLIPS * step * w_max
    worst = (err / tol).max().item()
    assert worst <= 1, f"products err {worst:.3g}x the bound for K={k}, x's step {step:.3g}"
