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
