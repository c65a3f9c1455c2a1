"""The one-row bf16 path (torch.mv) computes what F.linear does; the engine installs it for bf16."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tierlm.infer.engine import InferConfig
from tierlm.infer.gemv import GemvLinear, use_gemv


def test_one_row_matches_linear_and_rows_are_unchanged():
    torch.manual_seed(0)
    lin = nn.Linear(256, 96).to(torch.bfloat16)
    assert use_gemv(nn.Sequential(lin)) == 1 and type(lin) is GemvLinear
    x = torch.randn(1, 1, 256, dtype=torch.bfloat16)
    ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    y = lin(x)
    assert y.shape == (1, 1, 96) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.02)
    rows = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    assert torch.equal(lin(rows), F.linear(rows, lin.weight, lin.bias))  # several rows: F.linear itself


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
    want = (F.linear(x.float(), lin.weight.float(), lin.bias.float()).bfloat16() if slow
            else F.linear(x, lin.weight, lin.bias))
    y = lin(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    few = x[:, : gemv.UPCAST_MIN_ROWS // 2 - 1]  # below the threshold: the bf16 kernel either way
    assert torch.equal(lin(few), F.linear(few, lin.weight, lin.bias))
