"""The one-row bf16 path (our kernel, else torch.mv) computes what F.linear does; the engine installs it
for bf16."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tierlm.infer import fp32_product, native
from tierlm.infer.engine import InferConfig
from tierlm.infer.gemv import GemvLinear, bf16_matmul_is_slow, use_gemv

from .tolerances import fp32_sum_tol


def magnitude(lin, x):
    """The sum of the magnitudes of each output's terms: |x| @ |W|^T + |b| (fp64)."""
    xd = x.double().reshape(-1, x.shape[-1])
    return (xd.abs() @ lin.weight.double().abs().T + lin.bias.double().abs()).reshape(*x.shape[:-1], -1)


def bf16_rounded(got, ref, lin, x, roundings):
    """got (bf16) against ref (fp32 of the same bf16 x and weights): fp32 sums of K terms, and
    `roundings` roundings to bf16 on the way (each within 2^-9 of what it rounds: bf16 keeps 8
    significant bits), of values no larger than the terms' magnitudes."""
    mag = magnitude(lin, x)
    tol = fp32_sum_tol(x.shape[-1], mag) + roundings * 2.0 ** -9 * mag
    assert ((got.double() - ref.double()).abs() <= tol).all()


def bf16_apart(got, want, lin, x):
    """Two bf16 results of fp32 sums in two orders: the sums differ by twice fp32_sum_tol, and
    rounding them to bf16 adds at most one bf16 step, 2^-7 of the value at most."""
    d = 2 * fp32_sum_tol(x.shape[-1], magnitude(lin, x))
    assert ((got.double() - want.double()).abs() <= d + 2.0 ** -7 * (want.double().abs() + d)).all()


def few_rows_want(lin, x):
    """Below the fp32 threshold: our kernel (fp32 sums, rounded once) where bf16 products are slow
    and it builds, else the bf16 kernel itself."""
    if bf16_matmul_is_slow() and native.available():
        return F.linear(x.float(), lin.weight.float(), lin.bias.float()).bfloat16()
    return F.linear(x, lin.weight, lin.bias)


def test_one_row_matches_linear_and_rows_are_unchanged():
    torch.manual_seed(0)
    lin = nn.Linear(256, 96).to(torch.bfloat16)
    assert use_gemv(nn.Sequential(lin)) == 1 and type(lin) is GemvLinear
    x = torch.randn(1, 1, 256, dtype=torch.bfloat16)
    ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    y = lin(x)
    assert y.shape == (1, 1, 96) and y.dtype == torch.bfloat16
    bf16_rounded(y, ref, lin, x, roundings=2)  # ours: the result; torch.mv: the product and the bias add
    rows = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    got, want = lin(rows), few_rows_want(lin, rows)
    if bf16_matmul_is_slow() and native.available():  # fp32 sums in another order: one bf16 step
        bf16_apart(got, want, lin, rows)
    else:
        assert torch.equal(got, want)


def test_threads_must_be_positive():
    with pytest.raises(ValueError, match="--threads"):
        InferConfig(threads=0)


@pytest.mark.parametrize("slow", [True, False])
def test_many_rows_run_in_fp32_only_where_bf16_products_are_slow(monkeypatch, slow):
    from tierlm.infer import gemv
    monkeypatch.setattr(gemv, "bf16_matmul_is_slow", lambda: slow)
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).to(torch.bfloat16)
    use_gemv(nn.Sequential(lin))
    x = torch.randn(2, gemv.UPCAST_MIN_ROWS, 64, dtype=torch.bfloat16)
    want = (fp32_product.product(x.reshape(-1, 64).float(), lin.weight.float(), lin.bias.float()).bfloat16()
            .reshape(2, -1, 48) if slow else F.linear(x, lin.weight, lin.bias))
    y = lin(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    few = x[:, : gemv.UPCAST_MIN_ROWS // 2 - 1]  # below the threshold: never converted to fp32
    if slow and native.available():
        bf16_apart(lin(few), F.linear(few.float(), lin.weight.float(), lin.bias.float()).bfloat16(), lin, few)
    else:
        assert torch.equal(lin(few), F.linear(few, lin.weight, lin.bias))


def test_the_fp32_product_keeps_its_buffer_and_sums_like_linear():
    """Many-row products of converted weights (fp32_product): into one kept buffer (no fresh pages
    a product), oneDNN's fp32 sums where it runs, within fp32 summation of F.linear's, and the same
    bits every call."""
    torch.manual_seed(0)
    w = torch.randn(320, 1024, dtype=torch.bfloat16)
    x = torch.randn(40, 1024, dtype=torch.bfloat16)
    y = fp32_product.upcast_linear(x, w)
    kept = fp32_product.scratch(w.numel()).data_ptr()
    assert y.dtype == torch.bfloat16 and y.shape == (40, 320)
    assert torch.equal(fp32_product.upcast_linear(x, w), y)
    assert fp32_product.scratch(w.numel()).data_ptr() == kept  # the same buffer, not a new one
    assert fp32_product.scratch(10).data_ptr() == kept  # a smaller matrix reuses it too
    got = fp32_product.product(x.float(), w.float())
    mag = x.double().abs() @ w.double().abs().T
    assert ((got.double() - x.double() @ w.double().T).abs() <= fp32_sum_tol(1024, mag)).all()
    assert torch.equal(y, got.bfloat16())


def test_oneDNN_runs_the_fp32_products_on_x86_only(monkeypatch):
    import platform
    fp32_product.onednn_linear.cache_clear()
    try:
        monkeypatch.setattr(platform, "machine", lambda: "aarch64")
        assert not fp32_product.onednn_linear()
        fp32_product.onednn_linear.cache_clear()
        monkeypatch.setattr(platform, "machine", lambda: "x86_64")
        assert fp32_product.onednn_linear() == torch.backends.mkldnn.is_available()
    finally:
        fp32_product.onednn_linear.cache_clear()
