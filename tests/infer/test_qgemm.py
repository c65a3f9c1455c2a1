"""Many-row int8/int4 products in 8-bit integers (kernels/qgemm.c): against a float64 product of
the same rounded x, the same bits on every path and thread count, and where QLinear uses them."""
import os
import platform
import subprocess
import sys

import pytest
import torch

from tierlm.infer import fp32_product, native, qgemm, quant
from tierlm.infer.quant import NATIVE_MAX_ROWS, QLinear, _int8

from .test_native import int4_weight, needs_kernels, round8_groups
from .tolerances import STEP, check_products, fp32_sum_tol


def int8_reference(x, q, s, xg):
    """float64 of what the kernel computes: x rounded to 8 bits a group of xg, times q * s."""
    return round8_groups(x, xg).double() @ (q.double() * s.double()[:, None]).T


def int4_reference(x, sl, q, group):
    """float64: x rounded to 8 bits a group against scale * q, plus lo times x's own group sums."""
    rows, k = x.shape
    w = (q.double().view(q.shape[0], -1, group) * sl[..., :1].double()).view(q.shape[0], k)
    return round8_groups(x, group).double() @ w.T + x.double().view(rows, -1, group).sum(-1) @ sl[..., 1].double().T


def int4_magnitude(x, sl, q, group):
    rows, k = x.shape
    w = (q.double().view(q.shape[0], -1, group) * sl[..., :1].double().abs()).view(q.shape[0], k)
    return round8_groups(x, group).double().abs() @ w.T + \
        x.double().abs().view(rows, -1, group).sum(-1) @ sl[..., 1].double().abs().T


def int8_weight(n, k, seed=0):
    t = _int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), torch.float32)
    return t["qweight"], t["scales"]


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("k,xg", [(256, 128), (192, 64), (96, 32), (2048, 128)])
def test_int8_products_match_float64(rows, k, xg):
    assert qgemm.x_group(k) == xg
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)) * 3
    q, s = int8_weight(72, k)  # 72: a panel and a part of one
    got = qgemm.product(x, q, s)
    assert got.shape == (rows, 72) and got.dtype == torch.float32
    mag = round8_groups(x, xg).double().abs() @ (q.double().abs() * s.double()[:, None]).T
    check_products(got, int8_reference(x, q, s, xg), k, mag)
    # and within half a step of each input's rounding of the product of x itself
    half = x.abs().view(rows, -1, xg).amax(-1, keepdim=True).expand(rows, k // xg, xg).reshape(rows, k) * STEP["x8"] / 2
    plain = x.double() @ (q.double() * s.double()[:, None]).T
    assert ((got.double() - plain).abs() <= half.double() @ (q.double().abs() * s.double()[:, None]).T
            + fp32_sum_tol(k, mag)).all()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 6, 40])
@pytest.mark.parametrize("k,group", [(64, 32), (256, 64), (1024, 128), (768, 256)])
def test_int4_products_match_float64(rows, k, group):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    qw, sl, q = int4_weight(50, k, group)
    got = qgemm.product(x, qw, sl, group)
    assert got.shape == (rows, 50)
    check_products(got, int4_reference(x, sl, q, group), k, int4_magnitude(x, sl, q, group))


@needs_kernels
def test_integer_sums_are_exact_at_the_extremes():
    """x that rounds to +-127 against weights of -128/127 (int8) and 15 (int4), 8192 inputs: the
    integer sums (int8's shifted by 128 inside the VNNI loop) neither overflow nor saturate."""
    k = 8192
    x = torch.ones(5, k)
    x[1] = -1
    x[2, ::2] = -1
    q = torch.full((33, k), -128, dtype=torch.int8)
    q[1] = 127
    q[2, 1::2] = 127
    s = torch.ones(33)
    ref = x.double() @ q.double().T
    assert torch.equal(qgemm.product(x, q, s).double(), ref)  # every partial sum an integer below 2^24
    qw = torch.full((33, k // 2), 255, dtype=torch.uint8)  # q = 15 everywhere
    sl = torch.stack([torch.ones(33, k // 128), torch.zeros(33, k // 128)], -1)
    assert torch.equal(qgemm.product(x, qw, sl, 128).double(), x.double() @ torch.full((33, k), 15.0).double().T)


@needs_kernels
def test_result_does_not_depend_on_the_thread_count():
    q, s = int8_weight(200, 512)
    qw, sl, _ = int4_weight(200, 512, 128)
    x = torch.randn(45, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qgemm.product(x, q, s), qgemm.product(x, qw, sl, 128)
        torch.set_num_threads(2)
        two = qgemm.product(x, q, s), qgemm.product(x, qw, sl, 128)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_no_group_of_x_fits_a_width_that_32_does_not_divide():
    assert qgemm.x_group(100) is None and qgemm.x_group(5632) == 128
    if native.available():
        with pytest.raises(ValueError, match="no group of 8-bit x fits 100 inputs"):
            qgemm.product(torch.randn(40, 100), *int8_weight(8, 100))


_PATHS_CODE = """
import sys, torch
from tierlm.infer import native, qgemm
from tierlm.infer.quant import _int4, _int8
if len(sys.argv) > 2:  # the other loops capped lower (amx-emulated's weight packing without AVX-512)
    assert native.library().tierlm_native_set_isa(native.ISAS.index(sys.argv[2])) >= 0
g = torch.Generator().manual_seed(5)
cases = {}
# rows not a multiple of the AMX path's 16 or 32, widths not a multiple of a panel's 32, several groups,
# and groups of 32 and odd multiples of 32 (the AMX tiles' 32-byte depth) besides 64 and 128
for rows, k, n in ((1, 256, 40), (37, 192, 72), (64, 96, 33), (9, 1024, 65), (3, 160, 7), (6, 2048, 16),
                  (100, 384, 97), (33, 288, 40)):
    x = torch.randn(rows, k, generator=g) * 2
    w = torch.randn(n, k, generator=g)
    t = _int8(w, torch.float32)
    cases[f"int8 {rows} {k} {n}"] = (x, t["qweight"], t["scales"], 0)
    for group in (32, 64, 96, 128):
        if k % group == 0:
            t = _int4(w, torch.float32, group, "tierlm")
            cases[f"int4 {rows} {k} {n} {group}"] = (x, t["qweight"], t["scales"], group)
# the extremes: x at its groups' maximum (+-127 after rounding) against weights of -128, -127 and 127
# (int8) and 15 (int4), 4096 inputs, so that every pair of products and every group's sum is at its largest
k = 4096
x = torch.ones(7, k)
x[1] = -1
x[2, ::2] = -1
x[3, 1::2] = -1
x[4:] = torch.randn(3, k, generator=g)
q = torch.full((35, k), -128, dtype=torch.int8)
q[1] = 127
q[2, 1::2] = 127
q[3] = -127
q[4, ::2] = -127
q[5:] = torch.randint(-128, 128, (30, k), generator=g, dtype=torch.int8)
cases["int8 extremes"] = (x, q, torch.rand(35, generator=g) + 0.5, 0)
sl = torch.stack([torch.rand(35, k // 128, generator=g) + 0.5, torch.randn(35, k // 128, generator=g)], -1)
cases["int4 extremes"] = (x, torch.full((35, k // 2), 255, dtype=torch.uint8), sl, 128)
out = {}
for threads in (1, 2):
    torch.set_num_threads(threads)
    for key, (x, q, s, group) in cases.items():
        out[f"{key}, {threads} threads"] = qgemm.product(x, q, s, group)
torch.save({"isa": native.isa(), "amx_emulated": native.amx_emulated(), "fast": qgemm.fast(), "out": out,
            "cases": cases}, sys.argv[1])
"""


@needs_kernels
def test_every_path_gives_the_same_bits(tmp_path):
    """The portable loop, the AVX2 one, the AVX512-VNNI one and the AMX one compute the same integer
    sums and the same fp32 steps in the same order: their products are equal, bit for bit, on every
    path this CPU has and on 1 and 2 threads, the extremes of x and the weights included (where the
    AVX2 path's 16-bit pair sums would saturate if its operands were not |w| and x with w's sign).
    The AMX kernel also runs against the software tiles (amx-emulated) on any x86 CPU: the only
    check of its bits where the CPU has no AMX."""
    if os.environ.get("TIERLM_NATIVE_ISA"):
        pytest.skip(f"this run is already forced to {os.environ['TIERLM_NATIVE_ISA']}")
    got = {}
    emulated = [native.AMX_EMULATED] if platform.machine() in ("x86_64", "AMD64") else []
    if emulated and "avx512vnni" in native.supported_isas():
        emulated.append(f"{native.AMX_EMULATED} avx2")  # the word-at-a-time packing a CPU without AVX-512 takes
    for path in native.supported_isas() + emulated:
        f = tmp_path / f"{path}.pt"
        isa, *cap = path.split()
        r = subprocess.run([sys.executable, "-c", _PATHS_CODE, str(f), *cap], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "TIERLM_NATIVE_ISA": isa})
        assert r.returncode == 0, r.stderr[-2000:]
        got[path] = torch.load(f)
        if isa == native.AMX_EMULATED:  # the other loops on the CPU's highest path below amx, or the cap
            assert got[path]["amx_emulated"] and got[path]["isa"] == (cap or native.supported_isas()[:4])[-1]
        else:
            assert got[path]["isa"] == path and not got[path]["amx_emulated"]
            assert got[path]["fast"] is (path != "portable")  # the integer units from AVX2 up
    base = got["portable"]["out"]
    x, q, s, _ = got["portable"]["cases"]["int8 extremes"]
    exact = (x.double() @ q.double().T).float() * s  # +-1 rounds to +-127 at scale 1/127: exact here
    assert torch.equal(base["int8 extremes, 1 threads"][:4], exact[:4])
    for path, res in got.items():
        assert res["out"].keys() == base.keys()
        for key, y in res["out"].items():
            assert torch.equal(y, base[key.replace("2 threads", "1 threads")]), f"{path} differs from portable on {key}"


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_qlinear_takes_many_rows_in_integers_from_avx2_up(mode):
    lin = QLinear(256, 40, mode, group=64 if mode == "int4" else 0, has_bias=True)
    for name, t in lin.quantize(torch.randn(40, 256), torch.randn(40), torch.float32).items():
        setattr(lin, name, t)
    x = torch.randn(2, NATIVE_MAX_ROWS, 256)
    y = lin(x)
    assert y.shape == (2, NATIVE_MAX_ROWS, 40)
    ours = qgemm.product(x, lin.qweight, lin.scales, lin.group) + lin.bias
    assert lin.integer_rows(x.reshape(-1, 256)) == qgemm.fast()
    assert torch.equal(y.reshape(-1, 40), ours) == qgemm.fast()
    if not qgemm.fast():
        return
    quant.use_integer_rows(False)  # the fallback, as benchmarks/infer_prefill.py compares it
    try:
        assert not lin.integer_rows(x.reshape(-1, 256))
        fallback = lin(x).reshape(-1, 40)
    finally:
        quant.use_integer_rows(True)
    if mode == "int8":
        assert torch.equal(fallback, torch.ops.aten._weight_int8pack_mm(x.reshape(-1, 256), lin.qweight, lin.scales)
                           + lin.bias)
    else:
        w = native.dequant_int4(lin.qweight, lin.scales, 64)
        assert torch.equal(fallback, fp32_product.product(x.reshape(-1, 256), w) + lin.bias)
    x1 = x.reshape(-1, 256)[:NATIVE_MAX_ROWS]  # few rows stay on the few-row kernels
    few = native.gemv_int8(x1, lin.qweight, lin.scales) if mode == "int8" else \
        native.gemv_int4(x1, lin.qweight, lin.scales, 64)
    assert torch.equal(lin(x1), few + lin.bias)


@needs_kernels
def test_the_amx_path_runs_only_where_the_cpu_has_it():
    """amx runs only where CPUID, the OS and Linux's permission all allow the tiles (never on a
    CPU without them, where asking for it is an error that says why), and, until it has run on a CPU
    with AMX, only when named; elsewhere the highest path below runs the products."""
    if os.environ.get("TIERLM_NATIVE_ISA"):
        pytest.skip(f"this run is already forced to {os.environ['TIERLM_NATIVE_ISA']}")
    r = subprocess.run([sys.executable, "-c", "from tierlm.infer import native\nprint(native.isa())"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "TIERLM_NATIVE_ISA": "amx"})
    if "amx" in native.supported_isas():
        # named, it runs; unnamed, only once it is the default (AMX_BY_DEFAULT: after it ran on AMX)
        assert r.returncode == 0 and r.stdout.split() == ["amx"], r.stderr[-1500:]
        assert native.isa() == ("amx" if native.AMX_BY_DEFAULT else "avx512bf16")
        assert native.amx_unavailable() is None
        return
    why = native.amx_unavailable()
    assert native.isa() != "amx" and why
    cpuinfo = "/proc/cpuinfo"
    if os.path.exists(cpuinfo) and platform.machine() == "x86_64" and "amx_int8" not in open(cpuinfo).read():
        assert "no AMX-TILE and AMX-INT8" in why
    assert r.returncode != 0 and "ValueError: TIERLM_NATIVE_ISA=amx: this CPU has no amx path" in r.stderr \
        and why in r.stderr, r.stderr[-1500:]
