"""The phase report's rooflines: which bound a phase is closest to."""
from types import SimpleNamespace

import torch

from tierlm.infer import gemv
from tierlm.infer.report import compute_dtype, phase_line

RATES = {"mem_gbps": 30.0, "matmul_bf16_gflops": 0.3, "matmul_fp32_gflops": 170.0}


def test_a_bf16_model_on_a_cpu_without_fast_bf16_is_held_to_the_fp32_matmul_rate(monkeypatch):
    eng = SimpleNamespace(dtype=torch.bfloat16)
    monkeypatch.setattr(gemv, "bf16_matmul_is_slow", lambda: True)
    assert compute_dtype(eng) == "fp32"
    monkeypatch.setattr(gemv, "bf16_matmul_is_slow", lambda: False)
    assert compute_dtype(eng) == "bf16"
    assert compute_dtype(SimpleNamespace(dtype=torch.float32)) == "fp32"


def test_a_decode_phase_reading_weights_at_memory_speed_is_memory_bound():
    # 47 tokens of a 208M-parameter bf16 model in 0.7 s: 27.8 GB/s read, 28 GFLOP/s
    tokens, seconds, ram = 47, 0.703, 47 * 416_000_000
    flops = 2 * 208e6 * tokens
    _, d = phase_line("decode", seconds, tokens, ram, 0, 0, flops, RATES, "fp32")
    assert d["bound"] == "memory" and 0.9 < d["shares"]["memory"] < 1.0
    assert d["shares"]["compute"] < 0.2
    # held to the bf16 matmul rate of such a CPU it would read as 90x compute-bound
    _, d = phase_line("decode", seconds, tokens, ram, 0, 0, flops, RATES, "bf16")
    assert d["bound"] == "compute" and d["shares"]["compute"] > 50
