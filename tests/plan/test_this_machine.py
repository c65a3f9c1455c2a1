"""`--hardware this`: the plan follows today's engine (its budget split, its traffic, its measured
fixed costs), and uses the engine's own activation estimate. Never timed."""
import pytest
import torch

from tierlm.plan import budget as B
from tierlm.plan import cost as C
from tierlm.advise.command import hardware_from_measurements
from tierlm.plan.planner import Task, plan
from tierlm.advise.models import model_shape

OVERHEAD = {"train_per_step_s": 0.05, "train_per_layer_s": 0.02, "train_per_step_recompute_s": 0.05,
            "train_per_layer_recompute_s": 0.03, "decode_resident_per_step_s": 0.001,
            "decode_resident_per_layer_s": 0.0005, "decode_streamed_per_step_s": 0.002,
            "decode_streamed_per_layer_s": 0.004}


def measurements(overhead=True):
    comp = {"matmul_tflops": {"float32": 0.1, "bfloat16": 0.3, "float16": 0.1}, "adamw_elems_per_s": 1e9,
            "matmul_n": 2048, "threads": 2}
    if overhead:
        comp.update(layer_tflops={"512": 0.05, "2048": 0.2}, gemv_gbps=1.0, crc32c_gbps=5.0, overhead=OVERHEAD)
    return {"io": {"dir": "/x", "direct_io": True, "read_gbps": 0.8, "write_gbps": 1.0, "mem_gbps": 10.0,
                   "free_bytes": 100 << 30, "block_bytes": 16 << 20, "inflight": 4, "bytes": 1 << 30, "note": None},
            "compute": comp,
            "machine": {"cores": 2, "logical_cpus": 2, "ram_bytes": 24 << 30, "torch": "x", "when": "test"}}


@pytest.fixture(scope="module")
def shape(tmp_path_factory):
    from transformers import AutoConfig
    d = tmp_path_factory.mktemp("m")
    AutoConfig.for_model("llama", hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512).save_pretrained(d)
    return model_shape(str(d)), d


def test_activation_bytes_are_the_engines(shape):
    s, d = shape
    from transformers import AutoConfig
    assert C.layer_activation_bytes(s, 4096) == B.layer_activation_bytes(AutoConfig.from_pretrained(d), 4096,
                                                                          torch.bfloat16)


def test_traffic_is_the_engines_write_through_cache(shape):
    s, _ = shape
    hw = hardware_from_measurements(measurements())
    big = plan(s, hw, Task(batch=1, seq_len=128, activations="keep", cpu_mem=4 << 30, clip="off"))
    assert big.extra["resident_params"] == s.params  # every shard cached: state reads skipped ...
    assert big.traffic_bytes["ssd_read"] == 0  # and the room left keeps the weights (Split.weights_kept)
    assert big.traffic_bytes["ssd_write"] == s.params * 14  # ... its writes are not
    # with the cache off, the window keeps its size: the weights are read in forward and again in
    # backward for the layers it no longer holds, and the state once
    off = plan(s, hw, Task(batch=1, seq_len=128, activations="keep", cpu_mem=4 << 30, clip="off", state_cache=False))
    reread = s.params - 2 * s.layer_params - s.head_params
    assert off.traffic_bytes["ssd_read"] == (s.params + reread) * 2 + s.params * 12
    # the store's CRC32C of every byte runs on the same two cores as the compute
    assert big.resources_s["checksum"] == pytest.approx(
        (big.traffic_bytes["ssd_read"] + big.traffic_bytes["ssd_write"]) / 5e9)
    tight = plan(s, hw, Task(batch=1, seq_len=128, activations="keep", cpu_mem=120 << 20, clip="off"))
    assert tight.fits and tight.extra["resident_params"] < s.params
    assert tight.traffic_bytes["ssd_read"] > big.traffic_bytes["ssd_read"]


def test_budget_too_small_is_the_engines_explanation(shape):
    s, _ = shape
    p = plan(s, hardware_from_measurements(measurements()), Task(batch=1, seq_len=128, cpu_mem=8 << 20))
    assert not p.fits and any("--cpu-mem" in m and "Raise --cpu-mem" in m for m in p.problems)


def test_fixed_costs_add_per_step_and_per_layer(shape):
    s, _ = shape
    task = dict(batch=1, seq_len=128, cpu_mem=4 << 30, clip="off")
    with_o = plan(s, hardware_from_measurements(measurements()), Task(activations="keep", **task))
    assert with_o.resources_s["compute"] >= OVERHEAD["train_per_step_s"] + s.layers * OVERHEAD["train_per_layer_s"]
    rec = plan(s, hardware_from_measurements(measurements()), Task(activations="recompute", **task))
    assert rec.resources_s["compute"] > with_o.resources_s["compute"]
    # without the measured layer rate and overheads (an old cache) the large-GEMM rate is used
    bare = plan(s, hardware_from_measurements(measurements(overhead=False)), Task(activations="keep", **task))
    assert bare.resources_s["compute"] < with_o.resources_s["compute"]


def test_swap_moves_every_layer_to_nvme(shape):
    s, _ = shape
    hw = hardware_from_measurements(measurements())
    keep = plan(s, hw, Task(batch=2, seq_len=128, activations="keep", cpu_mem=4 << 30, clip="off"))
    swap = plan(s, hw, Task(batch=2, seq_len=128, activations="swap", cpu_mem=4 << 30, clip="off"))
    act = swap.activations["per_layer_bytes"]
    assert swap.activations["on_nvme"] == s.layers and swap.activations["in_ram"] == 0
    assert swap.traffic_bytes["ssd_write"] - keep.traffic_bytes["ssd_write"] == s.layers * act
    assert swap.step_s > keep.step_s


def test_decode_streamed_reads_every_layer_from_the_ssd(shape):
    s, _ = shape
    hw = hardware_from_measurements(measurements())
    ram = plan(s, hw, Task(kind="serve", batch=1, seq_len=16, new_tokens=8, cpu_mem=1 << 30))
    streamed = plan(s, hw, Task(kind="serve", batch=1, seq_len=16, new_tokens=8, cpu_mem=34 << 20))
    assert ram.placement["weights"]["nvme"] == 0
    assert streamed.placement["weights"]["nvme"] == s.layers * s.layer_params * 2
    assert streamed.extra["decode_tokens_per_s"] < ram.extra["decode_tokens_per_s"]
    assert ram.resources_s["overhead"] == pytest.approx(
        OVERHEAD["decode_resident_per_step_s"] + s.layers * OVERHEAD["decode_resident_per_layer_s"])


def test_bad_activation_policy_names_the_choices():
    with pytest.raises(ValueError, match="use auto, keep, swap or recompute"):
        Task(activations="offload").validate()


def test_layer_rate_interpolates_by_width_and_clamps():
    r = C.rates(hardware_from_measurements(measurements()), C.Efficiency())
    assert r.layer_rate(512) == pytest.approx(0.05e12) and r.layer_rate(256) == pytest.approx(0.05e12)
    assert r.layer_rate(1024) == pytest.approx(0.1e12)  # halfway in log width: the geometric mean
    assert r.layer_rate(8192) == pytest.approx(0.2e12)


def test_layer_rate_interpolates_by_tokens_too():
    m = measurements()
    m["compute"]["layer_tflops_by_tokens"] = {"256": {"512": 0.02, "2048": 0.08}, "2048": {"512": 0.05, "2048": 0.2}}
    r = C.rates(hardware_from_measurements(m), C.Efficiency())
    assert r.layer_rate(1024, 2048) == pytest.approx(0.1e12)
    assert r.layer_rate(1024, 256) == pytest.approx(0.04e12)
    assert r.layer_rate(1024, 724) == pytest.approx((0.04e12 * 0.1e12) ** 0.5, rel=1e-3)  # ~halfway in log tokens
    assert r.layer_rate(512, 64) == pytest.approx(0.02e12) and r.layer_rate(4096, 1 << 16) == pytest.approx(0.2e12)
    assert r.layer_rate(1024) == pytest.approx(0.1e12)  # no token count: the width alone, as before


def test_measured_overlap_adds_the_unhidden_share_of_the_shorter(shape):
    s, _ = shape
    task = dict(batch=1, seq_len=128, activations="keep", cpu_mem=4 << 30, clip="off")
    full = plan(s, hardware_from_measurements(measurements()), Task(**task))
    m = measurements()
    m["compute"]["overlap"] = 0.25
    part = plan(s, hardware_from_measurements(m), Task(**task))
    shorter = min(full.devices_s["cpu"], full.devices_s["ssd"])
    assert shorter > 0 and part.resources_s["overlap_penalty"] == pytest.approx(0.75 * shorter)
    assert part.step_s == pytest.approx(full.step_s + 0.75 * shorter)
    assert "overlap_penalty" not in full.resources_s  # older caches: perfect overlap, as before
    assert any("25% of the shorter is hidden" in a for a in part.assumptions)


def test_decode_uses_the_measured_rate_of_its_weight_format(shape):
    """`bench compute` times a decode step through layers in each weight format; the plan divides
    the layers' bytes in that format by its rate, and the bf16 head's by the bf16 rate."""
    s, _ = shape
    m = measurements()
    m["compute"]["decode_gbps"] = {"bf16": 1.0, "int8": 0.8, "int4": 0.5}
    hw = hardware_from_measurements(m)
    plans = {f: plan(s, hw, Task(kind="serve", batch=1, seq_len=16, new_tokens=8, cpu_mem=1 << 30, weights=f))
             for f in ("bf16", "int8", "int4")}
    head = s.vocab * s.hidden * 2 / 1e9
    for f, rate in m["compute"]["decode_gbps"].items():
        layers = s.layers * s.layer_params * C.weight_bytes_per_param(f, s.hidden)
        assert plans[f].resources_s["compute"] == pytest.approx(layers / (rate * 1e9) + head)
        assert plans[f].placement["weights"]["ram"] == pytest.approx(layers + (s.params - s.layers * s.layer_params) * 2)
    assert C.weight_bytes_per_param("int4", 2048) == 0.5625 and C.weight_bytes_per_param("int8", 2048) == 1 + 2 / 2048
    # a cache from before the formats were measured: every format at its one bf16 rate
    old = plan(s, hardware_from_measurements(measurements()), Task(kind="serve", seq_len=16, new_tokens=8,
                                                                 cpu_mem=1 << 30, weights="int8"))
    int8_layers = s.layers * s.layer_params * C.weight_bytes_per_param("int8", s.hidden)
    assert old.resources_s["compute"] == pytest.approx(int8_layers / 1e9 + head)
    assert any("no int8 decode rate" in x for x in old.assumptions)
    assert not any("decode rate" in x for x in plans["int8"].assumptions)


def test_weights_other_than_bf16_are_for_serving():
    with pytest.raises(ValueError, match="--weights int8 is for --task serve"):
        Task(kind="finetune", weights="int8").validate()
    with pytest.raises(ValueError, match="use bf16, int8 or int4"):
        Task(kind="serve", weights="fp8").validate()


def test_resident_weights_count_once_at_the_measured_decode_rate(shape):
    """The decode step `bench compute` times reads its weights from RAM: the plan does not count
    them again at bench io's memory rate (a copy's), which bound genoa-2c's in-RAM decode at 0.61 of
    what it ran. With that rate far below the decode rate, compute binds; the KV cache stays a
    memory term."""
    s, _ = shape
    m = measurements()
    m["compute"]["decode_gbps"] = {"bf16": 1.0}
    m["io"]["mem_gbps"] = 0.1  # a copy rate far below the decode step's
    p = plan(s, hardware_from_measurements(m), Task(kind="serve", batch=1, seq_len=16, new_tokens=8,
                                                    cpu_mem=1 << 30))
    assert p.binding == "cpu"
    weights = p.placement["weights"]["ram"]
    assert 0 < p.resources_s["memory"] < weights / 0.1e9 / 100


def test_the_models_own_step_sets_the_compute_where_measured_at_the_micro_batch(shape):
    """bench_model_step's seconds (this model's layer code at this micro-batch) replace the reference
    layers' interpolation; at another micro-batch, or another dtype, they are not used."""
    s, _ = shape
    hw = hardware_from_measurements(measurements())
    hw.measured["model_step"] = {"layer_s": 0.5, "rest_s": 0.7, "tokens": 256, "probed_tokens": 256, "seq": 128,
                                 "dtype": "bfloat16", "threads": 2, "model_type": "llama"}  # as run_plan adds it
    task = dict(batch=2, seq_len=128, cpu_mem=4 << 30, clip="off", precision="bf16")
    keep = plan(s, hw, Task(activations="keep", **task))
    o = OVERHEAD
    assert keep.resources_s["compute"] == pytest.approx(
        s.layers * 0.5 + 0.7 + o["train_per_step_s"] + s.layers * o["train_per_layer_s"])
    assert any("this model's own step measured here" in a for a in keep.assumptions)
    rec = plan(s, hw, Task(activations="recompute", **task))
    assert rec.resources_s["compute"] == pytest.approx(
        s.layers * 0.5 * (1 + 1 / 3) + 0.7 + o["train_per_step_s"] + s.layers * o["train_per_layer_recompute_s"])
    other = plan(s, hw, Task(activations="keep", **dict(task, batch=1)))  # 128 tokens: not what was measured
    assert any("reference llama layers" in a for a in other.assumptions)
    fp32 = plan(s, hw, Task(activations="keep", **dict(task, precision="fp32")))
    assert not any("own step" in a for a in fp32.assumptions)


def test_the_engines_own_step_sets_the_cpu_time_with_the_optimizer_inside(shape):
    """bench_engine_step's seconds (the model's step run by the engine, its optimizer and checksums
    on the same cores) are the CPU's time: the layers scaled to the model's depth plus the rest,
    no fixed costs or optimizer added again; only reads the probe did not make add to it."""
    s, _ = shape
    hw = hardware_from_measurements(measurements())
    hw.measured["model_step"] = {"layer_s": 0.5, "rest_s": 0.7, "step_s": 1.7, "layers": 2, "tokens": 256,
                                 "probed_tokens": 256, "seq": 128, "dtype": "bfloat16", "threads": 2,
                                 "model_type": "llama", "source": "engine", "steps": 4, "read_bytes": 0}
    task = dict(batch=2, seq_len=128, cpu_mem=4 << 30, clip="off", precision="bf16")
    keep = plan(s, hw, Task(activations="keep", **task))
    assert keep.resources_s["compute"] == pytest.approx(s.layers * 0.5 + 0.7)
    assert keep.devices_s["cpu"] == pytest.approx(keep.resources_s["compute"])  # the state is cached: no reads
    assert keep.resources_s["optimizer"] > 0  # reported, but inside the measured step
    assert any("this model's own step run by the engine here" in a for a in keep.assumptions)
    rec = plan(s, hw, Task(activations="recompute", **task))
    assert rec.resources_s["compute"] == pytest.approx(s.layers * 0.5 * (1 + 1 / 3) + 0.7)
    # a budget that caches no state: the reads beyond the probe's are checksummed on the same cores
    small = plan(s, hw, Task(activations="keep", **dict(task, state_cache=False)))
    beyond = small.resources_s["checksum_beyond_probe"]
    assert beyond > 0 and small.devices_s["cpu"] == pytest.approx(small.resources_s["compute"] + beyond)
    hw.measured["model_step"]["read_bytes"] = 1 << 40  # the probe read as much: nothing beyond
    assert plan(s, hw, Task(activations="keep", **dict(task, state_cache=False))).resources_s[
        "checksum_beyond_probe"] == 0


def test_engine_step_probe_takes_the_layer_from_the_engines_profile(monkeypatch, tmp_path):
    """The probe drives the engine and reads the first layer's time from the engine's own profile:
    a profile entry made 100 s longer shows up as the layer's time (nothing is timed against a
    threshold); the rest is the step less the probe's layers; the scratch folder is removed."""
    from transformers import AutoConfig

    from tierlm.bench import model_step
    from tierlm.engine.act_engine import ActivationPlanner

    real = ActivationPlanner.forward_end

    def forward_end(self, blk, dt, saved):
        return real(self, blk, dt + (100.0 if blk.index == min(self.cur) else 0.0), saved)
    monkeypatch.setattr(ActivationPlanner, "forward_end", forward_end)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    r = model_step.bench_engine_step(cfg, 64, 32, torch.float32, tmp_path, 256 << 20, "off", steps=3, warmup=1)
    assert 100 < r["layer_s"] < 200 and r["rest_s"] == 0.0  # the step itself took far less than 2 x 100 s
    assert r["source"] == "engine" and r["layers"] == 2 and r["steps"] == 2 and r["tokens"] == 64
    assert r["dtype"] == "float32" and r["model_type"] == "llama" and r["read_bytes"] == 0
    assert not list(tmp_path.iterdir())
    assert cfg.num_hidden_layers == 6  # the model's config is left as it was
    # a budget the engine refuses raises (the plan then times the bare layer) and leaves nothing behind
    with pytest.raises(Exception, match="cpu-mem"):
        model_step.bench_engine_step(cfg, 64, 32, torch.float32, tmp_path, 1 << 20, "off", steps=3, warmup=1)
    assert not list(tmp_path.iterdir())


def test_model_step_probe_times_the_layer_and_the_rest_and_scales_capped_rows(monkeypatch):
    from transformers import AutoConfig

    from tierlm.bench import measure, model_step

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    # The timings are stand-ins (never timed here): the one-layer model's step 1.0 s, its layer's
    # own 0.3 s. The steps themselves run: each starts with zero_grad on what it steps (the model,
    # or the layer called again with the arguments the model's forward gave it).
    real_best, real_zero = measure.best_seconds, torch.nn.Module.zero_grad
    ran = []

    def zero_grad(self, *a, **k):
        zero_grad.last = "model" if hasattr(self, "get_output_embeddings") else "layer"
        return real_zero(self, *a, **k)
    monkeypatch.setattr(torch.nn.Module, "zero_grad", zero_grad)

    def best(fn, repeats):
        real_best(fn, 1)
        ran.append(zero_grad.last)
        return {"model": 1.0, "layer": 0.3}[zero_grad.last]
    monkeypatch.setattr(measure, "best_seconds", best)
    monkeypatch.setattr(model_step, "MODEL_STEP_S", 10.0)  # a row's layer step (0.3 s): both rows fit
    monkeypatch.setattr(model_step, "MODEL_PROBE_S", 0.0)  # `repeats` rounds, no more
    r = model_step.bench_model_step(cfg, 64, 32, torch.float32, repeats=2)
    assert r["layer_s"] == pytest.approx(0.3) and r["rest_s"] == pytest.approx(0.7)
    assert r["probed_tokens"] == 64 and r["tokens"] == 64 and r["model_type"] == "llama"
    assert ran == ["layer", "model", "layer", "model", "layer"]  # the row check, then interleaved rounds
    # a layer too slow for the rows the run has: one row timed, scaled to the micro-batch per token
    monkeypatch.setattr(model_step, "MODEL_STEP_S", 0.5)
    r = model_step.bench_model_step(cfg, 128, 32, torch.float32, repeats=2)
    assert r["probed_tokens"] == 32 and r["layer_s"] == pytest.approx(0.3 * 4) and r["rest_s"] == pytest.approx(0.7 * 4)


def test_model_step_probe_replays_any_familys_layer_call():
    """The layer is called again with what the model's own forward passed it (gpt2's blocks take
    other arguments than llama's layers); real timings, only checked to be there."""
    from transformers import AutoConfig

    from tierlm.bench import model_step

    for arch, kw in (("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)),
                     ("qwen2", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True))):
        r = model_step.bench_model_step(AutoConfig.for_model(arch, **kw), 32, 16, torch.float32, repeats=1)
        assert r["layer_s"] > 0 and r["model_s"] > 0 and r["model_type"] == arch


def test_the_plan_predicts_the_runs_own_settings(shape, tmp_path):
    """What `tierlm plan --hardware this` predicts the engine will choose (read-ahead, shard size,
    I/O depth) is what the engine chooses from the same measurements: both resolve them with
    plan.settings.resolve_train."""
    from tierlm.engine.engine import Engine, EngineConfig
    from tierlm.hf.init import init_model
    from tierlm.plan.settings import Measured

    s, d = shape
    from transformers import AutoConfig
    model = tmp_path / "model"
    init_model(model, AutoConfig.from_pretrained(d))
    m = measurements()
    # a drive whose slow requests come late beside slow compute: a read-ahead other than the default
    m["io"].update(dir=str(tmp_path), queue_depth=8, shard_bytes=1 << 20, read_ms_p50=1.0, read_ms_p99=200.0)
    m["compute"].update(layer_dtype="fp32", layer_tflops_by_tokens={"128": {"256": 1e-3}})
    cpu_mem = 1 << 30
    p = plan(s, hardware_from_measurements(m), Task(batch=1, seq_len=128, cpu_mem=cpu_mem, precision="fp32"))
    compute = {k: m["compute"].get(k) for k in ("matmul_tflops", "layer_dtype", "layer_tflops_by_tokens")}
    eng = Engine.from_pretrained(model, EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem=cpu_mem, precision="fp32",
                                                     tokens_per_micro_batch=128),
                                 overwrite=True, measured=Measured(io=m["io"], compute=compute))
    try:
        ran = eng.settings.to_dict()
    finally:
        eng.close()
    for k in ("prefetch", "shard_elems", "io_threads"):
        assert p.settings[k] == ran[k], k
    assert ran["prefetch"]["value"] > 2 and ran["io_threads"]["value"] == 8  # the measurements' picks, not defaults


def test_a_probe_that_would_move_a_many_expert_state_times_the_layer_alone(tmp_path):
    """The engine-step probe runs a two-layer copy through the engine: for a mixture of many experts
    that copy updates, writes and reads back every expert's state each step (Qwen3-30B-A3B's: 1.8B
    parameters). Predicted past ENGINE_PROBE_MAX_S, the plan times the model's decoder layer alone
    (bench_model_step, cached under its own key) and says how long the engine's probe would have
    taken; a small dense model's probe goes through the engine. Nothing is run here."""
    from tierlm.advise import command
    from tierlm.advise.models import _config_for
    from tierlm.bench import model_step
    m = measurements()
    m["io"]["write_gbps"] = 0.3
    hw = hardware_from_measurements(m)
    task = Task(batch=1, seq_len=512, precision="bf16")
    moe = model_shape("qwen3-30b-a3b")
    config, _ = _config_for("qwen3-30b-a3b")
    key, (what, est), _ = command._train_probe(config, moe, task, hw, str(tmp_path), 2)
    assert key == model_step.model_step_key(config, 512, 512, torch.bfloat16)
    assert what.startswith("this model's own decoder layer") and "would take about" in what and est < 60
    # two layers of 128 experts: 1.8B parameters, whose state at 0.3 GB/s takes the probe past the limit
    from tierlm.plan import cost as C
    from tierlm.plan.finetune_time import probe_seconds
    P = moe.embed_params + moe.head_params + 2 * moe.layer_params
    assert P > 1.5e9 and probe_seconds(moe, task, C.rates(hw, C.Efficiency(), "bf16"), 512, 2, 8,
                                       24 << 30) > command.ENGINE_PROBE_MAX_S
    config, _ = _config_for("smollm2-135m")
    key, (what, est), _ = command._train_probe(config, model_shape("smollm2-135m"), task, hw, str(tmp_path), 2)
    assert key.startswith("engine|") and "through the engine" in what and est < command.ENGINE_PROBE_MAX_S
