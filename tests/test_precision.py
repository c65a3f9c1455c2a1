"""`--precision auto`: bf16 only where this CPU has bf16 matrix instructions (read from its ISA
flags, never timed); a resumed run keeps its own."""
import json
import time

import pytest

import tierlm
from tierlm import precision as P
from tierlm.engine.engine import EngineConfig
from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config


def _fake_isa(monkeypatch, isa):
    monkeypatch.setattr(P, "cpu_bf16_isa", lambda: isa)


def _fake_cpu(monkeypatch, machine, flags, torch_flags=None):
    """A CPU as platform, /proc/cpuinfo and torch's queries describe it (None: torch cannot tell)."""
    P.cpu_bf16_isa.cache_clear()
    monkeypatch.setattr(P.platform, "machine", lambda: machine)
    monkeypatch.setattr(P, "_cpuinfo_flags", lambda: set(flags))
    monkeypatch.setattr(P, "_torch_flag", lambda name: (torch_flags or {}).get(name))


@pytest.fixture(autouse=True)
def _fresh_isa():
    P.cpu_bf16_isa.cache_clear()
    yield
    P.cpu_bf16_isa.cache_clear()


@pytest.mark.parametrize("machine,flags,torch_flags,isa", [
    ("x86_64", {"avx2", "fma"}, None, None),                                        # AVX2-only EPYC
    ("x86_64", {"avx512f", "avx512_bf16"}, None, "AVX512_BF16"),                   # Zen 4, no torch query
    ("x86_64", {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, None, "AMX-BF16"),  # Sapphire Rapids
    ("x86_64", {"avx512f"}, {"_is_avx512_bf16_supported": True}, "AVX512_BF16"),    # torch's CPUID wins
    ("x86_64", {"avx512_bf16"}, {"_is_avx512_bf16_supported": False,                # torch: not usable
                                 "_is_amx_tile_supported": False}, None),
    ("x86_64", {"amx_tile", "amx_int8"}, {"_is_amx_tile_supported": True}, None),   # tiles, no bf16 ones
    ("aarch64", {"fp", "asimd", "bf16"}, None, "Arm BF16"),                         # Graviton 3
    ("aarch64", {"fp", "asimd"}, None, None),                                       # Graviton 2
])
def test_auto_follows_the_isa_flags(monkeypatch, machine, flags, torch_flags, isa):
    _fake_cpu(monkeypatch, machine, flags, torch_flags)
    assert P.cpu_bf16_isa() == isa
    chosen, why = P.resolve("auto")
    assert chosen == ("bf16" if isa else "fp32")
    assert f"chose {chosen}" in why
    assert (isa or "no bf16 matrix instructions") in why  # the reason names the ISA fact
    assert EngineConfig(nvme_dir="x", precision="auto").precision == chosen
    assert P.resolve("bf16")[0] == "bf16" and P.resolve("fp32")[0] == "fp32"  # given: as given


def test_this_cpu_reads_the_same_from_torch_and_cpuinfo():
    flags = P._cpuinfo_flags()
    if not flags or P.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("needs an x86 /proc/cpuinfo")
    isa = P.cpu_bf16_isa()
    assert (isa is not None) == bool({"avx512_bf16", "amx_bf16"} & flags)


@pytest.mark.parametrize("clock", ["slow", "fast", "broken"])
def test_auto_does_not_time_anything(monkeypatch, clock):
    """The old probe chose from a timing (bf16 9 times, fp32 3 times in 12 runs of one command on a
    busy machine). Whatever the clocks say, or if they cannot be read, auto gives the same."""
    expected = P.resolve("auto")
    P.cpu_bf16_isa.cache_clear()
    ticks = iter(range(10 ** 6))
    step = {"slow": 1000.0, "fast": 1e-9}.get(clock)

    def fake():
        if step is None:
            raise AssertionError("resolve('auto') read a clock")
        return next(ticks) * step

    for name in ("perf_counter", "monotonic", "time", "process_time"):
        monkeypatch.setattr(time, name, fake)
    assert P.resolve("auto") == expected
    assert (P.cpu_bf16_isa() is not None) == (expected[0] == "bf16")


def test_inference_choices_follow_the_same_predicate(monkeypatch):
    from tierlm.infer import gemv
    gemv.bf16_matmul_is_slow.cache_clear()
    try:
        assert gemv.bf16_matmul_is_slow() == (P.resolve("auto")[0] == "fp32")
        _fake_isa(monkeypatch, None)
        gemv.bf16_matmul_is_slow.cache_clear()
        assert gemv.bf16_matmul_is_slow() is True
        _fake_isa(monkeypatch, "AMX-BF16")
        gemv.bf16_matmul_is_slow.cache_clear()
        assert gemv.bf16_matmul_is_slow() is False
    finally:
        monkeypatch.undo()
        gemv.bf16_matmul_is_slow.cache_clear()


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match="auto, bf16, fp32"):
        P.resolve("fp16")


def test_resume_keeps_the_precision_of_the_state(monkeypatch, tmp_path):
    model = tmp_path / "m"
    init_model(model, make_config("llama", None, {"layers": 2, "hidden": 64}))
    data = tmp_path / "d.txt"
    data.write_text("a resumed run keeps the dtype its state was made in. " * 200)
    kw = dict(model=str(model), data=str(data), output=str(tmp_path / "run"), cpu_mem="256MiB", seq_len=32,
              timeline_step=0)
    _fake_isa(monkeypatch, None)
    tierlm.finetune(steps=2, **kw)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["precision"] == "fp32"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision"] == "fp32"
    assert "no bf16 matrix instructions" in summary["precision_reason"]  # the run records why
    _fake_isa(monkeypatch, "AVX512_BF16")  # state made elsewhere (or under another torch) resumes here
    tierlm.finetune(steps=3, resume="auto", allow_config_change=True, **kw)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    assert json.loads((tmp_path / "run" / "config.json").read_text())["precision"] == "fp32"
    assert "resumed" in json.loads((tmp_path / "run" / "summary.json").read_text())["precision_reason"]
