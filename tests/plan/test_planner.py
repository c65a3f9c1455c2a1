"""Plans are deterministic, explain what does not fit, name the binding resource, and land near the
published LoHan numbers (the check docs/planning.md reports)."""
import json

import pytest

from tierlm.plan.catalog import Catalog
from tierlm.plan.planner import Task, plan
from tierlm.advise.models import model_shape


@pytest.fixture(scope="module")
def cat():
    return Catalog()


def test_plans_are_deterministic(cat):
    a = plan(model_shape("llama-2-13b"), cat.parse("lohan"), Task(batch=8)).to_json()
    b = plan(model_shape("llama-2-13b"), cat.parse("lohan"), Task(batch=8)).to_json()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_step_is_the_busiest_device_plus_fill(cat):
    p = plan(model_shape("gpt3-175b"), cat.parse("lohan"), Task(batch=16))
    top = max(p.devices_s.values())
    assert p.devices_s[p.binding] == top
    assert top <= p.step_s <= top + sum(p.devices_s.values()) / p.model["layers"] + 1e-9


@pytest.mark.parametrize("model, batch, published", [("gpt3-13b", 64, 156.0), ("gpt3-175b", 16, 87.0)])
def test_lohan_published_throughput_within_factor_1_5(cat, model, batch, published):
    p = plan(model_shape(model), cat.parse("lohan"), Task(batch=batch, seq_len=1024))
    assert p.fits
    assert 1 / 1.5 <= p.tflops / published <= 1.5, (p.tflops, published)
    assert p.binding in p.devices_s


def test_gpu_too_small_says_by_how_much(cat):
    p = plan(model_shape("gpt3-175b"), cat.parse("lohan"), Task(batch=32))
    assert not p.fits
    msg = p.problems[0]
    assert "rtx4090 memory" in msg and "more than its 24.00 GiB" in msg and "--batch" in msg


def test_no_nvme_and_too_little_ram(cat):
    p = plan(model_shape("llama-3.1-70b"), cat.parse("a100-80g+64GiB"), Task(batch=1))
    assert not p.fits
    assert any("no NVMe" in m and "add drives" in m for m in p.problems)


def test_nvme_capacity_shortfall(cat):
    p = plan(model_shape("llama-3.1-405b"), cat.parse("h100-80g+512GiB+990pro*1"), Task(batch=1))
    assert any(m.startswith("NVMe capacity") and "more than" in m for m in p.problems)


def test_state_in_ram_takes_the_ssd_off_the_step(cat):
    cached = plan(model_shape("llama-2-7b"), cat.parse("rtx4090+512GiB+pm9a3*2"), Task(batch=4))
    streamed = plan(model_shape("llama-2-7b"), cat.parse("rtx4090+512GiB+pm9a3*2"), Task(batch=4, state_cache=False))
    assert cached.traffic_bytes["ssd_read"] == 0 < streamed.traffic_bytes["ssd_read"]
    assert streamed.resources_s["ssd_write"] > 0


def test_recompute_costs_compute(cat):
    auto = plan(model_shape("llama-2-13b"), cat.parse("lohan"), Task(batch=8))
    rec = plan(model_shape("llama-2-13b"), cat.parse("lohan"), Task(batch=8, activations="recompute"))
    assert rec.activations["recomputed"] == rec.model["layers"]
    assert rec.resources_s["compute"] > auto.resources_s["compute"]


def test_serve_placements(cat):
    small = plan(model_shape("llama-3.1-8b"), cat.parse("h100-server"), Task(kind="serve", batch=8))
    assert small.placement["compute"] == "gpu" and small.placement["weights"]["gpu"] > 0
    huge = plan(model_shape("llama-3.1-405b"), cat.parse("rtx4090+64GiB+pm9a3*4"), Task(kind="serve", batch=1))
    # 730 GB stream from the drives each token, through RAM and over PCIe: one of the two binds
    assert huge.fits and huge.placement["weights"]["nvme"] > 0 and huge.binding in ("ssd", "pcie")
    assert huge.extra["decode_tokens_per_s"] < small.extra["decode_tokens_per_s"]


def test_cost_per_million_tokens_is_stated(cat):
    p = plan(model_shape("llama-3.1-8b"), cat.parse("4090-workstation"), Task(kind="serve", batch=16))
    c = p.cost
    assert c["usd_per_million_tokens"] > 0 and c["lifetime_years"] == 3.0
    assert any("cost:" in a for a in p.assumptions)


def test_clip_redo_is_a_serial_second_pass(cat):
    hw = cat.parse("4090-workstation")
    on = plan(model_shape("llama-2-13b"), hw, Task(batch=4, state_cache=False))
    off = plan(model_shape("llama-2-13b"), hw, Task(batch=4, state_cache=False, clip="off"))
    redo = plan(model_shape("llama-2-13b"), hw, Task(batch=4, state_cache=False, clip="redo"))
    assert off.traffic_bytes["ssd_write"] < on.traffic_bytes["ssd_write"] < redo.traffic_bytes["ssd_write"]
    assert redo.step_s == pytest.approx(on.step_s + redo.resources_s["clip_redo"])


def test_quantised_weights_decode_faster_where_memory_binds(cat):
    """On a CPU server decoding reads every weight a token: int8 and int4 read 1 and ~0.56 bytes a
    parameter of the layers against bf16's 2, so they decode faster and hold less."""
    shape, hw = model_shape("llama-3.1-70b"), cat.parse("cpu-2s-genoa")
    p = {f: plan(shape, hw, Task(kind="serve", batch=1, weights=f)) for f in ("bf16", "int8", "int4")}
    assert p["bf16"].binding == "dram"
    ram = {f: p[f].placement["weights"]["ram"] for f in p}
    assert ram["int4"] < ram["int8"] < ram["bf16"]
    rate = {f: p[f].extra["decode_tokens_per_s"] for f in p}
    assert rate["int4"] > rate["int8"] > rate["bf16"]
    assert "int4 weights" in __import__("tierlm.advise.report", fromlist=["text"]).text(p["int4"])


def test_a_shape_is_named_for_the_model_asked_about(tmp_path):
    from transformers import AutoConfig
    assert model_shape("llama-2-13b").name == "llama-2-13b"
    AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=128).save_pretrained(tmp_path / "mine")
    assert model_shape(str(tmp_path / "mine")).name == "mine"


def test_a_config_that_counts_attention_sublayers_is_planned_by_its_decoder_layers():
    """LongCat-Flash's num_hidden_layers counts each decoder layer's two attention sublayers (its
    cache's entries): the shape has num_layers layers, each caching both sublayers' keys, so the
    whole KV cache a token takes is the model's own (hf.kv_layout), not half of it."""
    from tests.families import family_config
    from tierlm.hf.kv_layout import kv_token_bytes
    from tierlm.plan.shapes import shape_of
    cfg = family_config("longcat_flash", num_layers=3)
    assert cfg.num_hidden_layers == 6
    shape = shape_of(cfg, "longcat", "test")
    assert shape.layers == 3
    assert shape.layers * shape.kv_elems == kv_token_bytes(cfg) == 6 * (16 + 8)  # latent KV + rotary key
