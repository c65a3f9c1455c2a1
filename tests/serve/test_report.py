"""The phase report's rooflines: which bound a phase is closest to, against the rates the command reads."""
import json
from types import SimpleNamespace

import pytest
import torch

from tierlm.infer import gemv
from tierlm.serve.report import compute_dtype, phase_line

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


def _phases(decode_read=31e9):
    """A batcher and an engine as far as the report reads them: decode read `decode_read` bytes in 1 s."""
    stats = SimpleNamespace(s={"prefill": 0.1, "decode": 1.0}, tokens={"prefill": 10, "decode": 100},
                            ram={"prefill": 1e8, "decode": decode_read}, ssd={"prefill": 0, "decode": 0},
                            kv={"prefill": 0, "decode": 0})
    return SimpleNamespace(stats=stats), SimpleNamespace(flop_params=1e6, dtype=torch.float32, store=None)


def test_the_reports_rate_is_read_from_the_cache_dir(monkeypatch, tmp_path):
    """`tierlm generate` reads the rooflines from $TIERLM_CACHE_DIR/bench.json and hands them to
    the report: nothing is measured where they are cached."""
    import io
    import subprocess

    from tierlm.bench import rooflines
    from tierlm.serve.run import rated_report

    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path))
    key = rooflines.rates_key(None, torch.get_num_threads())
    (tmp_path / "bench.json").write_text(json.dumps({rooflines.SECTION: {key: {"mem_gbps": 40.0}}}))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("measured a cached rate"))
    batcher, eng = _phases(decode_read=30e9)
    rates, lines, out = rated_report(batcher, eng, [], io.StringIO())
    assert rates == {"mem_gbps": 40.0}
    assert out["decode"]["shares"]["memory"] == pytest.approx(30 / 40) and "memory 75%" in lines[-1]


def test_a_phase_faster_than_the_cached_roofline_measures_it_again(monkeypatch, tmp_path):
    """Decode read 31 GB/s against a roofline cached at 25 (a busier moment): measured again once,
    the faster kept (and cached), the share recomputed."""
    import io
    import subprocess

    from tierlm.bench import rooflines
    from tierlm.serve.run import rated_report

    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"mem_gbps": 25.0 if len(calls) == 1 else 33.0}), "")
    monkeypatch.setattr(subprocess, "run", run)
    assert rooflines.machine_rates()["mem_gbps"] == 25.0
    batcher, eng = _phases()
    err = io.StringIO()
    rates, lines, out = rated_report(batcher, eng, [], err)
    assert len(calls) == 2 and "measuring it again" in err.getvalue()
    assert out["decode"]["shares"]["memory"] == pytest.approx(31 / 33) and "memory 94%" in lines[-1]
    assert rates["remeasured"] and rooflines.machine_rates()["mem_gbps"] == 33.0 and len(calls) == 2
