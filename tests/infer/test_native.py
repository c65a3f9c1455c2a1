"""Our few-row int8, int4 and bf16 kernels (tierlm.infer.native) against a float64 product, and the fallback."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierlm.infer import fp32_product, native, qgemm
from tierlm.infer.quant import QLinear

from .tolerances import STEP, check_products, check_rounded, fp32_sum_tol, x_step

needs_kernels = pytest.mark.skipif(not native.available(), reason=f"no kernels: {native.why_unavailable()}")


def int8_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


def round16(x):
    """One row as the int8 kernel sees it: x * (32767 / max|x|) rounded half away from zero, in fp32
    as the kernel computes it, times the scale back."""
    m = x.abs().max()
    v = x * (torch.tensor(32767.0) / m)
    return torch.trunc(v + 0.5 * torch.sign(v)) * (m / 32767)


# On the avx512vnni and avx512bf16 paths one row's x is rounded lighter by default (kernels/gemv.c,
# x_light): to bf16 against bf16 weights (avx512bf16), to 8 bits a group of 128 against int8 weights
LIGHT = native.available() and native.light_x()


def on(path):
    """Whether the products run on `path` or a higher one (native.ISAS)."""
    return native.available() and native.ISAS.index(native.isa()) >= native.ISAS.index(path)


def one_row_x(x, kind):
    """One row of x as the one-row loops take it: bf16 weights, rounded to bf16 (light x) or x
    itself to 2^-17; int8, 8 bits a group of 128 (light x, a row of a multiple of 128 inputs on
    VNNI) or 16 bits a row."""
    if kind == "bf16":
        return x.bfloat16().float() if LIGHT and on("avx512bf16") else x
    if LIGHT and on("avx512vnni") and x.shape[-1] % 128 == 0:
        return round8_groups(x, 128)
    return round16(x)


def int4_weight(n, k, group, seed=0):
    """Our int4 layout of a random weight: (packed, (scale, lo) pairs, q as fp32 [n, k])."""
    from tierlm.infer.quant import _int4, dequant_int4
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    t = _int4(w, torch.float32, group, "tierlm")
    unit = torch.stack([torch.ones(n, k // group), torch.zeros(n, k // group)], -1)
    return t["qweight"], t["scales"], dequant_int4(t["qweight"], unit, group)


def round8_groups(x, group):
    """Rows as the int4 kernel sees them for groups of a multiple of 64: each group times
    127 / max|group| rounded half away from zero (fp32, as the kernel computes it), scaled back."""
    xg = x.view(x.shape[0], -1, group)
    m = xg.abs().amax(-1, keepdim=True)
    v = xg * (torch.tensor(127.0) / m)
    return (torch.trunc(v + 0.5 * torch.sign(v)) * (m / 127)).view(x.shape)


def int4_reference(x, sl, q, group):
    """What the int4 kernel computes, in float64: x rounded (8 bits a group for groups of a multiple
    of 64, else 16 bits a row) against scale * q, plus lo times each group's sum of x itself
    (kernels/gemv.c)."""
    rows, k = x.shape
    xr = (round8_groups(x, group) if group % 64 == 0 else torch.stack([round16(r) for r in x])).double()
    scale, lo = sl[..., 0].double(), sl[..., 1].double()
    w = (q.double().view(q.shape[0], -1, group) * scale[..., None]).view(q.shape[0], k)
    return xr @ w.T + x.double().view(rows, -1, group).sum(-1) @ lo.T


def int4_rounding_bound(x, sl, q, group):
    """How far the int4 products may be from x itself times the weights the int4 values stand for:
    each input within half a step of x (8 bits a group: of the group's largest |x|; 16 bits: of
    the row's), times |scale * q| (lo multiplies x's own sum), and fp32 sums."""
    rows, k = x.shape
    if group % 64 == 0:
        half = x.abs().view(rows, -1, group).amax(-1, keepdim=True).expand(rows, k // group, group) \
            .reshape(rows, k) * STEP["x8"] / 2
    else:
        half = x.abs().amax(-1, keepdim=True).expand(rows, k) * STEP["x16"] / 2
    wq = (q.view(q.shape[0], -1, group) * sl[..., :1].abs()).view(q.shape[0], k).double()
    return half.double() @ wq.T + fp32_sum_tol(k, int4_magnitude(x, sl, q, group))


def int4_magnitude(x, sl, q, group):
    """The sum of the magnitudes of the terms each int4 output sums (int4_reference's, and the lo
    term's x sums), for tolerances.check_products."""
    rows, k = x.shape
    xr = (round8_groups(x, group) if group % 64 == 0 else torch.stack([round16(r) for r in x])).double()
    w = (q.double().view(q.shape[0], -1, group) * sl[..., 0].double().abs()[..., None]).view(q.shape[0], k)
    return xr.abs() @ w.T + x.double().abs().view(rows, -1, group).sum(-1) @ sl[..., 1].double().abs().T


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("k,group", [(64, 32), (2048, 128), (768, 256)])
def test_int4_products_match_float64(rows, k, group):
    from tierlm.infer.quant import dequant_int4
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    qw, sl, q = int4_weight(67, k, group)
    got = native.gemv_int4(x, qw, sl, group)
    assert got.shape == (rows, 67) and got.dtype == torch.float32
    check_products(got, int4_reference(x, sl, q, group), k, int4_magnitude(x, sl, q, group))
    # and within x's rounding of the product with the weights the int4 values stand for: each input
    # within half a step of x (8 bits a group: of the group's largest |x|; 16 bits: of the row's),
    # times |scale * q| (lo multiplies x's own sum)
    plain = x.double() @ dequant_int4(qw, sl, group).double().T
    assert ((got.double() - plain).abs() <= int4_rounding_bound(x, sl, q, group)).all()


@needs_kernels
def test_int4_dequantised_by_our_kernel_equals_torch_ops():
    from tierlm.infer.quant import dequant_int4
    for k, group in ((64, 32), (2048, 128), (768, 256)):
        qw, sl, _ = int4_weight(37, k, group)
        # the kernel's fused multiply-add rounds once where torch's mul and add round twice
        torch.testing.assert_close(native.dequant_int4(qw, sl, group), dequant_int4(qw, sl, group),
                                   rtol=1e-6, atol=1e-6)


def test_int4_packing_round_trips():
    from tierlm.infer.quant import dequant_int4, pack_int4
    q = torch.randint(0, 16, (5, 96), generator=torch.Generator().manual_seed(0))
    unit = torch.stack([torch.ones(5, 3), torch.zeros(5, 3)], -1)
    assert torch.equal(dequant_int4(pack_int4(q), unit, 32), q.float())


@needs_kernels
def test_int4_group_must_divide_the_row_in_multiples_of_32():
    qw, sl, _ = int4_weight(8, 96, 32)
    with pytest.raises(ValueError, match="int4 group 48"):
        native.gemv_int4(torch.randn(1, 96), qw, torch.ones(8, 2, 2), 48)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9])
@pytest.mark.parametrize("k", [16, 40, 2056, 2048])  # whole vectors, a tail only, vectors and a tail; groups of 128
def test_products_match_float64(rows, k):
    n = 67
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    q, s = int8_weight(n, k)
    xr = x.double()
    if rows == 1:  # one row runs in integers: x rounded with scales (kernels/gemv.c)
        xr = one_row_x(x, "int8").double()
    w8 = q.double() * s.double()[:, None]
    got = native.gemv_int8(x, q, s)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # 8-bit x against sign-flipped weights sums (q + 128) * x and takes 128 * sum(x) off after
    flipped = rows == 1 and LIGHT and on("avx512vnni") and k % 128 == 0
    check_products(got, xr @ w8.T, k, xr.abs() @ ((q.double().abs() + 128 * flipped) * s.double()[:, None]).T)
    w = torch.randn(n, k).bfloat16()
    xb = (one_row_x(x, "bf16") if rows == 1 else x).double()
    check_products(native.gemv_bf16(x, w), xb @ w.double().T, k, xb.abs() @ w.double().abs().T)


@needs_kernels
def test_one_row_int8_integer_sums_do_not_overflow():
    """The largest products (|w| = 128, x at full scale) over a long row: integer sums move to
    fp32 before they could overflow."""
    k = 3 * 4096 + 40
    q = torch.full((3, k), -128, dtype=torch.int8)
    x = torch.full((1, k), -1.0)
    got = native.gemv_int8(x, q, torch.ones(3))
    assert torch.equal(got, torch.full((1, 3), 128.0 * k))


@needs_kernels
@pytest.mark.parametrize("w", [127, -128])
def test_one_row_int8_of_8_bit_x_is_exact_at_the_extremes(w):
    """8-bit x (groups of 128, weights sign-flipped to unsigned): the largest products of either
    sign over a long row; integer sums per group stay exact in fp32."""
    k = 3 * 4096
    q = torch.full((3, k), w, dtype=torch.int8)
    for v in (1.0, -1.0):
        got, want = native.gemv_int8(torch.full((1, k), v), q, torch.ones(3)), torch.full((1, 3), v * w * k)
        check_products(got, want, k, want.abs())  # terms of one sign: their magnitudes sum to |y|


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3])
def test_several_matrices_in_one_call_equal_one_call_each(rows):
    """A layer's q, k and v (or gate and up) in one parallel region: the threads split the rows
    of all of them, and each output is what its own call gives."""
    x = torch.randn(rows, 520)
    mats = [int8_weight(n, 520, seed=n) for n in (64, 8, 8, 130)]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            ys = native.products(x, [q for q, _ in mats], [s for _, s in mats])
            assert all(torch.equal(y, native.gemv_int8(x, q, s)) for y, (q, s) in zip(ys, mats))
            side = native.products(x, [q for q, _ in mats], [s for _, s in mats], concat=True)
            assert torch.equal(side, torch.cat(ys, -1))
            bs = [torch.randn(n, 520).bfloat16() for n in (64, 8, 130)]
            ys = native.products(x, bs)
            assert all(torch.equal(y, native.gemv_bf16(x, b)) for y, b in zip(ys, bs))
    finally:
        torch.set_num_threads(before)
    x = torch.randn(rows, 512)
    m4 = [int4_weight(n, 512, 64, seed=n) for n in (64, 8, 130)]
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            ys = native.products(x, [a for a, _, _ in m4], [b for _, b, _ in m4], group=64)
            assert all(torch.equal(y, native.gemv_int4(x, a, b, 64)) for y, (a, b, _) in zip(ys, m4))
            side = native.products(x, [a for a, _, _ in m4], [b for _, b, _ in m4], concat=True, group=64)
            assert torch.equal(side, torch.cat(ys, -1))
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("one_plus", [False, True])  # llama's norms scale by the weight, gemma's by 1 + weight
def test_the_norm_folded_into_the_call_is_an_rmsnorm(rows, one_plus):
    x = torch.randn(rows, 300) * 3
    q, s = int8_weight(40, 300)
    w = torch.randn(40, 300).bfloat16()
    isa, light = native.isa(), native.light_x()
    w8 = (q.float() * s[:, None]).abs()
    for nw in (torch.randn(300), torch.randn(300).bfloat16()):
        # the norm in C against torch's: x differs by fp32 rounding, where x is then rounded
        # (tolerances.x_step) an input may land a step away
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (nw.float() + one_plus)
        mag = normed.abs() @ w.float().abs().T
        check_rounded(native.products(x, [w], norm=(nw, 1e-5, one_plus))[0], native.gemv_bf16(normed, w), 300, mag,
                      x_step("bf16", normed, 0, light, isa), w.float().abs().max().item())
        got, ref = native.products(x, [q], [s], norm=(nw, 1e-5, one_plus))[0], native.gemv_int8(normed, q, s)
        check_rounded(got, ref, 300, normed.abs() @ w8.T, x_step("int8", normed, 0, light, isa), w8.max().item())
        qw, sl, q4 = int4_weight(40, 320, 32)
        x4 = torch.randn(rows, 320) * 3
        n4 = nw.repeat(2)[:320]
        normed = x4 * torch.rsqrt(x4.pow(2).mean(-1, keepdim=True) + 1e-5) * (n4.float() + one_plus)
        check_rounded(native.products(x4, [qw], [sl], norm=(n4, 1e-5, one_plus), group=32)[0],
                      native.gemv_int4(normed, qw, sl, 32), 320, int4_magnitude(normed, sl, q4, 32),
                      x_step("int4", normed, 32, light, isa),
                      (q4.view(40, -1, 32) * sl[..., :1].abs()).max().item())


@needs_kernels
def test_a_kept_call_equals_a_fresh_one_and_follows_moved_weights():
    """native.KeptCall keeps its argument arrays between calls; when a weight moves (a streamed
    layer in another buffer) it rebuilds them, and its fp32 scales stay those of its modules."""
    mats = [int8_weight(n, 256, seed=n) for n in (32, 8)]
    scales = [s.bfloat16() for _, s in mats]  # as QLinear holds them in a bf16 model
    nw = torch.randn(256).bfloat16()
    call = native.KeptCall()
    for step in range(3):
        qs = [q.clone() for q, _ in mats] if step == 2 else [q for q, _ in mats]  # step 2: new buffers
        x = torch.randn(1, 256)
        want = native.products(x, qs, scales, concat=True, norm=(nw, 1e-6))
        assert torch.equal(call(x, qs, scales, norm=(nw, 1e-6)), want)

    # fp32 scales in a buffer that then holds another layer's: the kept scales are a copy
    (q, s), = [int8_weight(16, 256, seed=3)]
    call, x = native.KeptCall(), torch.randn(1, 256)
    buf = s.clone()
    want = native.gemv_int8(x, q, s)
    assert torch.equal(call(x, [q], [buf])[:, :16], want)
    buf.zero_()
    q2 = q.clone()  # the layer installed elsewhere, its scales too
    assert torch.equal(call(x, [q2], [s.clone()]), want)


@needs_kernels
def test_a_kept_int4_call_follows_moved_weights_and_scales():
    """int4's (scale, lo) pairs are used where they are: a layer installed elsewhere moves both."""
    qw, sl, _ = int4_weight(48, 256, 64)
    call, x = native.KeptCall(), torch.randn(2, 256)
    want = native.gemv_int4(x, qw, sl, 64)
    assert torch.equal(call(x, [qw], [sl], group=64), want)
    qw2, sl2 = qw.clone(), sl.clone()
    sl.zero_()  # the old buffer now holds another layer's
    assert torch.equal(call(x, [qw2], [sl2], group=64), want)


@needs_kernels
def test_result_does_not_depend_on_the_thread_count():
    q, s = int8_weight(513, 1000)
    w = torch.randn(513, 1000).bfloat16()
    before = torch.get_num_threads()
    for rows in (1, 3):
        x = torch.randn(rows, 1000)
        try:
            torch.set_num_threads(1)
            one = native.gemv_int8(x, q, s), native.gemv_bf16(x, w)
            torch.set_num_threads(2)
            two = native.gemv_int8(x, q, s), native.gemv_bf16(x, w)
        finally:
            torch.set_num_threads(before)
        assert all(torch.equal(a, b) for a, b in zip(one, two))
    qw, sl, _ = int4_weight(513, 1024, 128)
    x = torch.randn(3, 1024)
    try:
        torch.set_num_threads(1)
        one = native.gemv_int4(x, qw, sl, 128)
        torch.set_num_threads(2)
        two = native.gemv_int4(x, qw, sl, 128)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3])
def test_rows_taken_from_another_thread_give_the_same_products(rows):
    """A thread done with its share of a product's rows takes the back half of another's
    (tl_rows_shared): whoever computes a row, the products are the same bit for bit. Thread 0 held
    back (set_steal(2)) makes the other take its rows; with set_steal(0) none are taken."""
    x = torch.randn(rows, 256)
    q, s = int8_weight(4096, 256)
    w = torch.randn(4096, 256).bfloat16()
    qw, sl, _ = int4_weight(4096, 256, 64)
    before = torch.get_num_threads()
    out, steals = {}, {}
    try:
        torch.set_num_threads(2)
        for mode in (0, 2):
            native.set_steal(mode)
            native.steals()
            out[mode] = (native.gemv_int8(x, q, s), native.gemv_bf16(x, w), native.gemv_int4(x, qw, sl, 64))
            steals[mode] = native.steals()
    finally:
        native.set_steal(1)
        torch.set_num_threads(before)
    assert steals[0] == 0 and steals[2] >= 3, steals  # a take in each of the three products
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[2]))


@needs_kernels
def test_int8_qlinear_uses_ours_for_few_rows_and_agrees_with_pytorchs_kernel():
    lin = QLinear(256, 96, "int8")
    for name, t in lin.quantize(torch.randn(96, 256), None, torch.float32).items():
        setattr(lin, name, t)
    for rows in (1, 7, 33):  # 33: above NATIVE_MAX_ROWS, PyTorch's kernel itself (or, from AVX2 up, qgemm)
        x = torch.randn(rows, 256)
        xr = x
        if rows == 1:  # ours rounds one row (kernels/gemv.c); PyTorch's is given the same x
            xr = one_row_x(x, "int8")
        torch_y = torch.ops.aten._weight_int8pack_mm(xr, lin.qweight, lin.scales)
        y = lin(x)
        if rows == 33:  # (tests/infer/test_qgemm.py tests qgemm's products)
            assert torch.equal(y, qgemm.product(x, lin.qweight, lin.scales) if qgemm.fast() else torch_y)
        else:  # the same rounded x, fp32 sums in two orders (and sign-flipped weights for 8-bit x)
            flipped = rows == 1 and LIGHT and on("avx512vnni")
            w = (lin.qweight.double().abs() + 128 * flipped) * lin.scales.double()[:, None]
            check_rounded(y, torch_y, 256, xr.double().abs() @ w.T, 0.0, 0.0)


@needs_kernels
def test_int4_qlinear_uses_ours_for_few_rows_and_integers_or_fp32_for_many():
    from tierlm.infer.quant import dequant_int4
    lin = QLinear(256, 96, "int4", group=64)
    assert lin.layout == "tierlm"
    for name, t in lin.quantize(torch.randn(96, 256), None, torch.float32).items():
        setattr(lin, name, t)
    w = dequant_int4(lin.qweight, lin.scales, 64)
    for rows in (1, 7, 33):  # 33: above NATIVE_MAX_ROWS, dequantised and multiplied in fp32
        x = torch.randn(rows, 256)
        y = lin(x)
        if rows == 33 and qgemm.fast():  # 8-bit x a group, integer sums (test_qgemm.py)
            assert torch.equal(y, qgemm.product(x, lin.qweight, lin.scales, 64))
        elif rows == 33:
            assert torch.equal(y, fp32_product.product(x, native.dequant_int4(lin.qweight, lin.scales, 64)))
            torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-4)
        else:
            assert torch.equal(y, native.gemv_int4(x, lin.qweight, lin.scales, 64))
            unit = torch.stack([torch.ones(96, 4), torch.zeros(96, 4)], -1)
            q = dequant_int4(lin.qweight, unit, 64)
            assert ((y.double() - x.double() @ w.double().T).abs() <= int4_rounding_bound(x, lin.scales, q, 64)).all()


def run_py(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


# The product tests: every kernel (each format, one row and several, the fused layer's own
# loops) against its reference; run again on each path below the CPU's highest (which the suite
# itself runs)
PRODUCT_TESTS = ("float64 or several or norm or kept or thread_count or same_products or dequantised or qlinear or "
                 "overflow or exact_at or transformers_forward or per_product_layer or one_row_matches or many_rows")
PRODUCT_FILES = [str(Path(__file__).with_name(f)) for f in ("test_native.py", "test_fused.py", "test_gemv.py")]


@needs_kernels
@pytest.mark.parametrize("path", native.ISAS)
def test_the_product_tests_pass_on_each_path_this_cpu_has(path):
    """TIERLM_NATIVE_ISA caps the kernels at a path (portable: what a CPU without AVX2 runs, ARM
    servers included; avx2: a CPU without AVX-512), which this CPU would otherwise never run: the
    product tests pass on each path it has too."""
    if os.environ.get("TIERLM_NATIVE_ISA"):
        pytest.skip(f"this run is already forced to {os.environ['TIERLM_NATIVE_ISA']}")
    if path not in native.supported_isas():
        pytest.skip(f"this CPU has no {path} path (it has {', '.join(native.supported_isas())})")
    if path == native.supported_isas()[-1]:
        pytest.skip(f"{path} is this CPU's highest path: the rest of the suite runs it")
    r = run_py("from tierlm.infer import native\nprint(native.isa())", TIERLM_NATIVE_ISA=path)
    assert r.returncode == 0 and r.stdout.strip() == path, r.stderr
    r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
                        *PRODUCT_FILES, "-k", PRODUCT_TESTS], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "TIERLM_NATIVE_ISA": path})
    assert r.returncode == 0, r.stdout[-3000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary), summary


def test_a_path_the_cpu_lacks_or_no_path_is_an_error(monkeypatch):
    """Naming a path this CPU lacks stops with a message that names it (a CPU with only the portable
    path stands in here), as does a name that is no path or a switch
    TIERLM_NATIVE_ISA replaced; none falls back quietly to another path or to PyTorch's kernels."""
    class PortableOnly:
        def tierlm_native_cpu_isa(self):
            return 0

        def tierlm_native_set_isa(self, lv):
            raise AssertionError("capped at a path the CPU lacks")
    monkeypatch.setenv("TIERLM_NATIVE_ISA", "avx2")
    with pytest.raises(ValueError, match=r"this CPU has no avx2 path \(it has portable\)"):
        native._cap_isa(PortableOnly())
    for env, says in (({"TIERLM_NATIVE_ISA": "avx3"}, "'avx3' is none of portable, avx2, avx512vnni, avx512bf16"),
                      ({"TIERLM_NATIVE_ISA": "", "TIERLM_NATIVE_PORTABLE": "1"}, "set TIERLM_NATIVE_ISA=portable"),
                      ({"TIERLM_NATIVE_ISA": "", "TIERLM_NATIVE_VNNI": "0"}, "set TIERLM_NATIVE_ISA=avx2")):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(ValueError, match=re.escape(says)):
            native._requested_isa()
        for k in env:
            monkeypatch.delenv(k)
    # and through the library's first use, not caught as a build failure
    r = run_py("from tierlm.infer import native\nnative.available()", TIERLM_NATIVE_ISA="avx3")
    assert r.returncode != 0 and "ValueError: TIERLM_NATIVE_ISA='avx3' is none of" in r.stderr, r.stderr[-1500:]


# On avx512vnni one int8 row takes AVX512-VNNI, and on avx512bf16 one bf16 row AVX512-BF16; the
# path below takes the AVX2 loop: (the path, the one below, the product made by `make`)
AVX512_ROWS = [
    ("avx512bf16", "avx512vnni",
     "w = torch.randn(300, 2050).bfloat16()\ny, weff = native.gemv_bf16(x, w), w.float()"),
    ("avx512vnni", "avx2",
     "d = _int8(torch.randn(300, 2050), torch.float32)\n"
     "y, weff = native.gemv_int8(x, d['qweight'], d['scales']), d['qweight'].float() * d['scales'][:, None]"),
]


@needs_kernels
@pytest.mark.parametrize("path,below,make", AVX512_ROWS, ids=[f for f, _, _ in AVX512_ROWS])
def test_the_avx512_row_loops_agree_with_the_avx2_ones(path, below, make, tmp_path):
    """bf16: x in two bf16 halves through vdpbf16ps (2^-17 of |x|) against widening every weight;
    int8: the same exact integer sums through vpdpwssd, added in another order. The two loops
    agree to that rounding (each path's product tests: the test above)."""
    if path not in native.supported_isas():
        pytest.skip(f"this CPU has no {path} path")
    exact = {"TIERLM_NATIVE_EXACT_X": "1"}  # the AVX-512 loops' exact forms; light x: the test below
    code = ("import sys, torch\nfrom tierlm.infer import native\nfrom tierlm.infer.quant import _int8\n"
            "torch.manual_seed(0)\nx = torch.randn(1, 2050)\n" + make + "\ntorch.save((x, weff, y), sys.argv[1])")
    outs = []
    for p in (path, below):
        out = tmp_path / f"y-{p}.pt"
        r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **exact, "TIERLM_NATIVE_ISA": p})
        assert r.returncode == 0, r.stderr
        outs.append(torch.load(out))
    (x, w, fast), (_, _, avx2) = outs
    scale = x.double().abs() @ w.double().abs().T
    assert ((fast.double() - avx2.double()).abs() / scale).max() < 2 ** -17


@needs_kernels
def test_light_x_rounds_one_row_as_said_and_exact_x_passes_the_kernel_tests_too(tmp_path):
    """By default the AVX-512 one-row loops take x rounded to bf16 (bf16 weights) or to 8 bits a
    group of 128 (int8, vpdpbusd on sign-flipped weights); TIERLM_NATIVE_EXACT_X=1 keeps the exact
    forms (x to 2^-17). Both give what their rounding of x times the weights gives, and with exact
    x the product tests pass as written for it."""
    if not LIGHT:
        pytest.skip("no AVX-512 one-row loops here: x is rounded one way only")
    r = run_py("from tierlm.infer import native\nprint(native.light_x())", TIERLM_NATIVE_EXACT_X="1")
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
    code = ("import sys, torch\nfrom tierlm.infer import native\nfrom tierlm.infer.quant import _int8\n"
            "torch.manual_seed(0)\nx = torch.randn(1, 2048) * torch.linspace(0.1, 4, 2048)\n"
            "w = torch.randn(300, 2048).bfloat16()\nd = _int8(torch.randn(300, 2048), torch.float32)\n"
            "torch.save((x, w, d['qweight'], d['scales'], native.gemv_bf16(x, w),"
            " native.gemv_int8(x, d['qweight'], d['scales'])), sys.argv[1])")
    outs = {}
    for flag in ("0", "1"):
        path = tmp_path / f"y{flag}.pt"
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "TIERLM_NATIVE_EXACT_X": flag})
        assert r.returncode == 0, r.stderr
        outs[flag] = torch.load(path)
    x, w, q, s, yb, yi = outs["0"]
    _, _, _, _, eb, ei = outs["1"]
    wi = q.double() * s.double()[:, None]
    for got, xr, wd in ((yb, x.bfloat16().double(), w.double()), (yi, round8_groups(x, 128).double(), wi),
                        (eb, x.double(), w.double()), (ei, round16(x).double(), wi)):
        ref = xr @ wd.T
        assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # and the light forms differ from the exact ones by their rounding of x, no more
    scale = x.double().abs() @ w.double().abs().T
    assert 2 ** -14 < ((yb.double() - eb.double()).abs() / scale).max() < 2 ** -8
    scale = x.double().abs() @ wi.abs().T
    assert 2 ** -14 < ((yi.double() - ei.double()).abs() / scale).max() < 2 ** -7
    # switched between calls in one process (benchmarks compare the two on one engine): the same results
    try:
        native.set_light_x(False)
        assert not native.light_x()
        assert torch.equal(native.gemv_bf16(x, w), eb) and torch.equal(native.gemv_int8(x, q, s), ei)
        native.set_light_x(True)
        assert torch.equal(native.gemv_bf16(x, w), yb) and torch.equal(native.gemv_int8(x, q, s), yi)
    finally:
        native.set_light_x(True)
    r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", __file__,
                        "-k", "float64 or several or norm or kept or thread or qlinear"], capture_output=True,
                       text=True, timeout=900, env={**os.environ, "TIERLM_NATIVE_EXACT_X": "1"})
    assert r.returncode == 0, r.stdout[-3000:]


def test_switched_off_it_says_so_and_int8_runs_on_pytorchs_kernel():
    r = run_py("from tierlm.infer import native\nimport torch\nfrom tierlm.infer.quant import QLinear\n"
               "l = QLinear(64, 8, 'int8')\n"
               "[setattr(l, n, t) for n, t in l.quantize(torch.randn(8, 64), None, torch.float32).items()]\n"
               "x = torch.randn(1, 64)\n"
               "assert torch.equal(l(x), torch.ops.aten._weight_int8pack_mm(x, l.qweight, l.scales))\n"
               "l4 = QLinear(128, 16, 'int4', group=32)\n"
               "assert l4.layout == 'torch'\n"
               "w = torch.randn(16, 128)\n"
               "[setattr(l4, n, t) for n, t in l4.quantize(w, None, torch.float32).items()]\n"
               "x = torch.randn(1, 128)\n"
               "torch.testing.assert_close(l4(x), x @ w.T, rtol=0.2, atol=0.2 * float((x @ w.T).abs().max()))\n"
               "print(native.available(), native.why_unavailable())", TIERLM_NATIVE="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False TIERLM_NATIVE=0"


def test_a_failing_compiler_is_named_and_nothing_breaks(tmp_path):
    r = run_py("from tierlm.infer import native\nprint(native.available())",
               CC="false", TIERLM_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert "false failed on" in r.stderr and "gemv.c" in r.stderr and "using PyTorch's" in r.stderr
