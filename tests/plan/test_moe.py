"""Mixtures of experts in the planner: counts against the models transformers builds, the decode
bound's arithmetic, fine-tuning compute from active parameters and bytes from all, decode reading
the experts a token is routed to through an expert cache."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tierlm.advise import report
from tierlm.advise.models import model_shape
from tierlm.plan import cost as C
from tierlm.plan.catalog import Catalog
from tierlm.plan.moe import MoeBytes, MoeShape, moe_decode_bound, moe_shape, tier_reads, uniform_hit_rate
from tierlm.plan.planner import Task, plan
from tierlm.plan.shapes import shape_of

_BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             intermediate_size=96, eos_token_id=None, bos_token_id=None, pad_token_id=None)
# Each family with the config names it uses, and the layers of experts its options leave (of 3).
FAMILIES = {
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), 3),
    "qwen2_moe": (dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, mlp_only_layers=[1]), 2),
    "qwen3_moe": (dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, head_dim=16,
                       decoder_sparse_step=2), 1),
    "olmoe": (dict(num_experts=8, num_experts_per_tok=2), 3),
    "deepseek_v3": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                         first_k_dense_replace=1, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1), 2),
    "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16), 3),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_counts_match_the_model_transformers_builds(family):
    """Total = every parameter of the real model; active = the same with each stacked expert
    parameter scaled by top_k / E, counted here from the module tree of a model built on the CPU."""
    extra, moe_layers = FAMILIES[family]
    config = AutoConfig.for_model(family, **{**_BASE, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    k = config.num_experts_per_tok
    total = sum(p.numel() for p in model.parameters())
    experts = {p.shape[0] for n, p in model.named_parameters() if ".experts." in n}
    active = sum(p.numel() * k // p.shape[0] if ".experts." in n else p.numel() for n, p in model.named_parameters())
    s = shape_of(config, family, "test")
    assert s.params == total and s.active_params == active < total
    assert s.moe.experts in experts and s.moe.top_k == k and s.moe.moe_layers == moe_layers
    assert s.moe.dense_params + s.moe.routed_params == total
    assert s.layers * s.layer_params == pytest.approx(total - s.embed_params - s.head_params, abs=s.layers)
    # FLOPs a token: the layers' active parameters and the output projection
    assert s.matmul_params == active - s.embed_params - s.head_params + s.vocab * s.hidden


def test_a_dense_model_has_no_experts():
    s = model_shape("llama-3.1-8b")
    assert s.moe is None and s.active_params == s.params and s.active_layer_params == s.layer_params
    assert "moe" not in s.to_json() or s.to_json()["moe"] is None


def test_moe_shape_arithmetic_and_routed_reads():
    m = moe_shape(1000 + 2 * 8 * 10, [0, 80, 80], experts=8, top_k=2)
    assert (m.expert_params, m.moe_layers, m.routed_params, m.dense_params) == (10, 2, 160, 1000)
    assert m.active_params == 1000 + 2 * 2 * 10 and m.all_experts == 16
    assert m.routed_read_params(1) == 40
    # more rows read more distinct experts, never more than all of them
    assert 40 < m.routed_read_params(4) < m.routed_read_params(64) <= m.routed_params
    assert m.routed_read_params(10_000) == pytest.approx(m.routed_params)
    with pytest.raises(ValueError, match="different sizes"):
        moe_shape(500, [80, 40], experts=8, top_k=2)
    with pytest.raises(ValueError, match="experts a token"):
        moe_shape(500, [80], experts=8, top_k=9)


def test_uniform_hit_rate():
    assert uniform_hit_rate(64, 256) == 0.25 and uniform_hit_rate(300, 256) == 1.0 and uniform_hit_rate(0, 0) == 1.0


def test_decode_bound_is_the_documented_sum():
    b = moe_decode_bound(dense_bytes=2e9, routed_bytes=8e9, hit_rate=0.25, ram_bps=100e9, ssd_bps=10e9,
                         compute_s=0.01)
    assert b.ram_s == pytest.approx((2e9 + 0.25 * 8e9) / 100e9)
    assert b.ssd_s == pytest.approx(0.75 * 8e9 / 10e9)
    assert b.total_s == pytest.approx(b.ram_s + b.ssd_s + 0.01)
    assert sum(b.shares().values()) == pytest.approx(1.0)
    full = moe_decode_bound(2e9, 8e9, 1.0, 100e9, 0.0)  # everything cached: no drive needed
    assert full.ssd_s == 0.0 and full.total_s == pytest.approx(0.1)
    streamed = moe_decode_bound(2e9, 8e9, 1.0, 100e9, 10e9, dense_ssd_bytes=1e9)
    assert streamed.ssd_s == pytest.approx(0.1)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="hit rate"):
            moe_decode_bound(1, 1, bad, 1, 1)
    with pytest.raises(ValueError, match="SSD"):
        moe_decode_bound(1, 8, 0.5, 1, 0)


def test_tier_reads_put_the_dense_part_first():
    b = MoeBytes(dense=100, routed=400, routed_read=40, expert=10, active_token=140)
    t = tier_reads({"gpu": 0, "ram": 300, "nvme": 200}, b, all_experts=40)
    assert t.dense == {"gpu": 0, "ram": 100, "nvme": 0}
    assert t.experts == {"gpu": 0, "ram": 20, "nvme": 20} and t.shares["ram"] == 0.5
    assert t.reads == {"gpu": 0, "ram": 120, "nvme": 20}
    squeezed = tier_reads({"gpu": 0, "ram": 60, "nvme": 440}, b, all_experts=40)
    assert squeezed.dense["nvme"] == 40 and squeezed.experts["ram"] == 0 and squeezed.reads["nvme"] == 80


@pytest.fixture(scope="module")
def mixtral():
    return model_shape("mixtral-8x7b")


def test_finetune_computes_active_and_moves_every_parameter(mixtral):
    """6 x active x tokens FLOPs; every parameter's state through the SSD (transformers stacks a
    layer's experts in one tensor, so every step updates all of them)."""
    s = mixtral
    task = Task(batch=2, seq_len=512, state_cache=False, activations="keep")
    p = plan(s, Catalog().parse("4090-workstation"), task)
    T = 2 * 512
    active_matmul = s.moe.active_params - s.embed_params - s.head_params + s.vocab * s.hidden
    assert p.extra["model_flops"] == pytest.approx(6.0 * active_matmul * T + 3 * C.attention_fwd_flops(s, 256, T))
    assert p.extra["model_flops"] < 0.3 * 6.0 * s.params * T  # 12.9B of 46.7B a token
    # catalog layout with no state cached: master, m, v, new weights and the saved gradient, each parameter
    assert p.traffic_bytes["ssd_write"] == s.params * (C.OPT_BYTES + C.W_BYTES + C.GRAD_BYTES)
    assert p.resources_s["optimizer"] == pytest.approx(s.params / p.hardware["rates"]["adam_elems"])
    assert any("stacks a layer's experts" in a for a in p.assumptions)
    assert p.extra["moe"]["active_params"] == s.active_params
    assert "active a token" in report.text(p)



def test_the_engine_probes_time_counts_every_experts_state(mixtral):
    """`tierlm plan`'s "about N s" for its engine-step probe: a mixture's idle experts compute
    nothing but are updated, written and read back every step, so the estimate counts all of a
    probe layer's parameters at the optimizer's and the drive's rates, not only its FLOPs."""
    from tierlm.plan.finetune_time import INIT_PARAMS_PER_S, layout, probe_seconds
    s, task = mixtral, Task(batch=1, seq_len=512, precision="bf16")
    r = C.rates(Catalog().parse("4090-workstation"), C.Efficiency(), "bf16")
    T, steps = 512, 8
    P = s.embed_params + s.head_params + 2 * s.layer_params
    est = probe_seconds(s, task, r, T, 2, steps, budget=0)
    lay = layout(task)
    per_step = 6.0 * T * (2 * s.active_layer_params + s.vocab * s.hidden) / r.cpu_flops + P / r.adam_elems \
        + P * lay.state / r.ssd_read + P * (lay.state + lay.w_write + lay.grad) / r.ssd_write
    assert est == pytest.approx(P / INIT_PARAMS_PER_S + P * lay.ssd_state / r.ssd_write + steps * per_step)
    # the compute alone is a small part of it: 2 of mixtral's 8 experts a token
    assert 6.0 * T * 2 * s.active_layer_params / r.cpu_flops * steps < 0.5 * est
    # state the budget caches is not read back
    assert probe_seconds(s, task, r, T, 2, steps, budget=P * lay.ram_state) == \
        pytest.approx(est - steps * P * lay.state / r.ssd_read)

def test_decode_reads_the_active_bytes_from_ram_when_everything_fits(mixtral):
    s = mixtral
    p = plan(s, Catalog().parse("cpu-2s-genoa"), Task(kind="serve", batch=1))
    e = p.extra["moe"]
    W = s.params * C.W_BYTES  # bf16 everywhere
    assert e["active_bytes_per_token"] == pytest.approx(s.moe.active_params * C.W_BYTES)
    assert e["routed_bytes_per_step"] == pytest.approx(s.moe.moe_layers * 2 * s.moe.expert_params * C.W_BYTES)
    assert e["hit_rate"] == 1.0 and e["experts_held"]["ram"] == s.moe.all_experts
    assert p.placement["weights"]["ram"] == pytest.approx(W) and p.binding == "dram"
    # the step reads the active bytes, not the whole model: memory time is theirs
    assert p.resources_s["memory"] == pytest.approx((e["active_bytes_per_token"] + p.extra["kv_cache_bytes"])
                                                    / p.hardware["rates"]["dram"])
    assert e["bound"]["ssd_s"] == 0.0 and e["bound"]["shares"]["ram"] > 0.5


def test_decode_with_a_small_expert_cache_reads_misses_from_the_ssd(mixtral):
    s, hw = mixtral, Catalog().parse("cpu-2s-genoa")
    task = Task(kind="serve", batch=1, cpu_mem=30 << 30)
    p = plan(s, hw, task)
    e, r = p.extra["moe"], p.hardware["rates"]
    h = e["hit_rate"]
    assert 0 < h < 1 and h == uniform_hit_rate(e["experts_held"]["ram"], s.moe.all_experts)
    # the expert cache is what --cpu-mem leaves after the dense part, the KV cache and the compute scratch
    scratch = C.compute_working_bytes(s, task.batch * task.seq_len) // 4
    dense = s.moe.dense_params * C.W_BYTES
    assert e["experts_held"]["ram"] == (task.cpu_mem - dense - p.extra["kv_cache_bytes"] - scratch) // e["expert_bytes"]
    bound = moe_decode_bound(e["active_bytes_per_token"] - e["routed_bytes_per_step"], e["routed_bytes_per_step"], h, r["dram"], r["ssd_read"],
                             e["bound"]["compute_s"])
    assert e["bound"]["total_s"] == pytest.approx(bound.total_s) and e["bound"]["ssd_s"] > 0
    assert p.resources_s["ssd_read"] == pytest.approx((1 - h) * e["routed_bytes_per_step"] / r["ssd_read"])
    full = plan(s, hw, Task(kind="serve", batch=1))
    assert p.extra["decode_tokens_per_s"] < full.extra["decode_tokens_per_s"]
    text = report.text(p)
    assert "uniform routing assumed" in text and "decode bound" in text and "SSD (misses)" in text
    assert any("routing taken as uniform" in a for a in p.assumptions)


def test_a_batch_reads_more_experts_a_step_than_one_token(mixtral):
    hw = Catalog().parse("cpu-2s-genoa")
    one = plan(mixtral, hw, Task(kind="serve", batch=1)).extra["moe"]
    eight = plan(mixtral, hw, Task(kind="serve", batch=8)).extra["moe"]
    assert one["routed_bytes_per_step"] < eight["routed_bytes_per_step"] <= \
        mixtral.moe.routed_params * C.W_BYTES


def test_moe_shape_json_has_derived_counts():
    m = MoeShape(4, 2, 10, 3, 500)
    assert m.to_json()["active_params"] == 500 - 120 + 60 and m.to_json()["routed_params"] == 120


def test_this_machine_follows_the_inference_engines_expert_placement():
    """`--hardware this --cpu-mem`: the experts the plan caches are plan.expert_placement's, the
    inference engine's own rule (dense parts resident as far as they fit, the rest an expert cache);
    with room for everything, whole layers stay resident and every expert hits."""
    from tierlm.advise.command import hardware_from_measurements
    from tierlm.plan.expert_placement import plan_expert_placement
    from tierlm.plan.inference import InferConfig, scratch_bytes
    from tierlm.plan.serve_plan import INFER_BASELINE

    from .test_this_machine import measurements
    config = AutoConfig.for_model("mixtral", **{**_BASE, **FAMILIES["mixtral"][0], "hidden_size": 256,
                                                "intermediate_size": 512, "num_local_experts": 8})
    s = shape_of(config, "tiny-mixtral", "test")
    hw = hardware_from_measurements(measurements())
    task = Task(kind="serve", batch=1, seq_len=16, new_tokens=8, cpu_mem=36 << 20)
    p = plan(s, hw, task)
    e = p.extra["moe"]
    cfg = InferConfig(cpu_mem=task.cpu_mem, max_batch=1, max_seq_len=24)
    kv = 25 * C.kv_bytes_per_token(s)
    ep = plan_expert_placement(cfg, INFER_BASELINE, (s.embed_params + s.head_params) * 2,
                               s.moe.dense_layer_params * 2, s.layers, kv,
                               scratch_bytes(C.hf_like_config(s), cfg, 24), (s.moe.expert_params * 2, 8, 3))
    assert p.fits and 0 < e["experts_held"]["ram"] == ep.slots < s.moe.all_experts
    assert e["hit_rate"] == ep.cached_share and e["bound"]["ssd_s"] > 0
    roomy = plan(s, hw, Task(kind="serve", batch=1, seq_len=16, new_tokens=8, cpu_mem=1 << 30)).extra["moe"]
    assert roomy["hit_rate"] == 1.0 and roomy["bound"]["ssd_s"] == 0.0


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_the_plans_kv_bytes_are_what_the_engines_cache_holds(family):
    """Latent attention (DeepSeek-V3) caches its compressed KV and its rotary key, one head each, not
    keys and values of every head: the plan's KV bytes a token equal the inference engine's cache."""
    from tierlm.infer.kvcache import SlotKVCache

    from ..families import family_config

    cfg = family_config(family)
    s = shape_of(cfg, family, "config")
    cache = SlotKVCache(cfg, 1, 7, torch.bfloat16)   # 7 positions + the spare one a slot keeps
    assert C.kv_bytes_per_token(s) * 8 == cache.nbytes
    if family == "deepseek_v3":
        assert s.kv_elems == cfg.kv_lora_rank + cfg.qk_rope_head_dim != 2 * s.kv_dim
