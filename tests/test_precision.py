"""`--precision auto`: bf16 only where this CPU multiplies bf16 matrices fast; a resumed run keeps its own."""
import json

import pytest

import tierlm
from tierlm import precision as P
from tierlm.engine.engine import EngineConfig
from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config


def _fake_probe(monkeypatch, ratio):
    monkeypatch.setattr(P, "probe", lambda: {"worst_ratio": ratio, "bf16_gflops": 10.0 * ratio,
                                             "fp32_gflops": 10.0, "capability": "TEST", "layouts": {}})


def test_probe_measures_every_layout_in_both_dtypes():
    p = P.probe()
    assert set(p["layouts"]) == {"forward x@W^T", "backward g@W", "backward g^T@x"}
    assert all(r["fp32_flops"] > 0 and r["bf16_flops"] > 0 for r in p["layouts"].values())
    assert p["worst_ratio"] == min(r["ratio"] for r in p["layouts"].values())
    chosen, why = P.resolve("auto")
    assert chosen == ("bf16" if p["worst_ratio"] >= P.MIN_BF16_SHARE else "fp32")
    assert f"chose {chosen}" in why


@pytest.mark.parametrize("ratio,chosen", [(0.01, "fp32"), (0.49, "fp32"), (0.5, "bf16"), (3.0, "bf16")])
def test_auto_follows_the_measured_ratio(monkeypatch, ratio, chosen):
    _fake_probe(monkeypatch, ratio)
    assert P.resolve("auto")[0] == chosen
    assert EngineConfig(nvme_dir="x", precision="auto").precision == chosen
    assert P.resolve("bf16")[0] == "bf16" and P.resolve("fp32")[0] == "fp32"  # given: not measured


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
    _fake_probe(monkeypatch, 0.01)
    tierlm.finetune(steps=2, **kw)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["precision"] == "fp32"
    _fake_probe(monkeypatch, 3.0)  # the same machine now measures bf16 as fast
    tierlm.finetune(steps=3, resume="auto", allow_config_change=True, **kw)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    assert json.loads((tmp_path / "run" / "config.json").read_text())["precision"] == "fp32"
