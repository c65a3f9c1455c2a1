"""Our few-row int8 and bf16 kernels (tierlm.infer.native) against a float64 product, and the fallback."""
import os
import subprocess
import sys

import pytest
import torch

from tierlm.infer import native
from tierlm.infer.quant import QLinear

needs_kernels = pytest.mark.skipif(not native.available(), reason=f"no kernels: {native.why_unavailable()}")


def int8_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9])
@pytest.mark.parametrize("k", [16, 40, 2056])  # whole vectors, a tail only, vectors and a tail
def test_products_match_float64(rows, k):
    n = 67
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    q, s = int8_weight(n, k)
    ref = x.double() @ (q.double() * s.double()[:, None]).T
    got = native.gemv_int8(x, q, s)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    w = torch.randn(n, k).bfloat16()
    ref = x.double() @ w.double().T
    torch.testing.assert_close(native.gemv_bf16(x, w).double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernels
def test_result_does_not_depend_on_the_thread_count():
    x = torch.randn(3, 1000)
    q, s = int8_weight(513, 1000)
    w = torch.randn(513, 1000).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.gemv_int8(x, q, s), native.gemv_bf16(x, w)
        torch.set_num_threads(2)
        two = native.gemv_int8(x, q, s), native.gemv_bf16(x, w)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@needs_kernels
def test_int8_qlinear_uses_ours_for_few_rows_and_agrees_with_pytorchs_kernel():
    lin = QLinear(256, 96, "int8")
    for name, t in lin.quantize(torch.randn(96, 256), None, torch.float32).items():
        setattr(lin, name, t)
    for rows in (1, 7, 33):  # 33: above NATIVE_MAX_ROWS, PyTorch's kernel itself
        x = torch.randn(rows, 256)
        torch_y = torch.ops.aten._weight_int8pack_mm(x, lin.qweight, lin.scales)
        y = lin(x)
        if rows == 33:
            assert torch.equal(y, torch_y)
        else:
            torch.testing.assert_close(y, torch_y, rtol=1e-5, atol=1e-4)


def run_py(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_switched_off_it_says_so_and_int8_runs_on_pytorchs_kernel():
    r = run_py("from tierlm.infer import native\nimport torch\nfrom tierlm.infer.quant import QLinear\n"
               "l = QLinear(64, 8, 'int8')\n"
               "[setattr(l, n, t) for n, t in l.quantize(torch.randn(8, 64), None, torch.float32).items()]\n"
               "x = torch.randn(1, 64)\n"
               "assert torch.equal(l(x), torch.ops.aten._weight_int8pack_mm(x, l.qweight, l.scales))\n"
               "print(native.available(), native.why_unavailable())", TIERLM_NATIVE="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False TIERLM_NATIVE=0"


def test_a_failing_compiler_is_named_and_nothing_breaks(tmp_path):
    r = run_py("from tierlm.infer import native\nprint(native.available())",
               CC="false", TIERLM_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert "false failed on" in r.stderr and "gemv.c" in r.stderr and "using PyTorch's" in r.stderr
