"""Activation policies: keep, swap (NVMe), swap-host, recompute, mixed per layer, and the planner.

Every policy moves or regenerates the same bits, so weights after N steps equal plain PyTorch's
bit for bit (fp32), with gradient accumulation and clipping, for every architecture.
"""
import json

import pytest
import torch

from tierlm.plan import activations as P
from tierlm.engine.activations import ActivationSwapper
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.storage import BudgetError

from .test_exactness import batches, run_engine, run_reference

HP = dict(lr=1e-3, wd=0.01, clip=0.5, accum=2, warmup=1, precision="fp32")


@pytest.fixture(autouse=True)
def swap_small_tensors(monkeypatch):
    # Tiny test models save tensors of a few KiB; swap them all so every path runs.
    monkeypatch.setattr(ActivationSwapper, "min_bytes", 0)


def _plan(tmp_path, activations):
    return json.loads((tmp_path / f"nvme-fp32-{activations}" / "plan.json").read_text())


@pytest.mark.parametrize("activations", ["swap", "swap-host", "swap,recompute,keep", "recompute,swap-host,swap"])
def test_policies_equal_torch_adamw_bit_for_bit(make_model_dir, tmp_path, activations):
    model_dir, model = make_model_dir("llama")
    data = batches(6, seq=16)
    _, ref_masters, ref_losses, _ = run_reference(model, data, **HP)
    masters, _, losses, _ = run_engine(model_dir, tmp_path, data, activations=activations, **HP)
    assert losses == ref_losses
    for n, m in ref_masters.items():
        assert torch.equal(masters[n], m), n
    last = _plan(tmp_path, activations)["steps"][-1]
    assert list(last["policies"].values()) == (activations.split(",") * 3)[:3]
    swapped = last["swapped_bytes"]
    if "swap" in activations.split(","):
        assert swapped["nvme"] > 0
    if "swap-host" in activations:
        assert swapped["host"] > 0


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gpt2"])
def test_swap_for_every_architecture(make_model_dir, tmp_path, arch):
    model_dir, model = make_model_dir(arch)
    data = batches(4, seq=16)
    hp = dict(HP, accum=1)
    _, ref_masters, _, _ = run_reference(model, data, **hp)
    masters, _, _, _ = run_engine(model_dir, tmp_path, data, activations="swap", **hp)
    for n, m in ref_masters.items():
        assert torch.equal(masters[n], m), (arch, n)


def test_auto_profiles_plans_and_logs_measured_beside_predicted(make_model_dir, tmp_path, monkeypatch):
    # Any two profiles agree: the plan is final after step 3 (steps 2 and 3 profiled), and step 4
    # is measured against it. (Whether real timings agree is plan.activations.settle's test below.)
    monkeypatch.setattr(P, "SETTLE_TOLERANCE", float("inf"))
    model_dir, _ = make_model_dir("llama")
    run_engine(model_dir, tmp_path, batches(8, seq=16), activations="auto", **HP)
    doc = json.loads((tmp_path / "nvme-fp32-auto" / "plan.json").read_text())
    assert doc["plan"]["made_after_step"] == 3
    assert doc["profiled_steps"] == 2 and doc["profile_settled"]
    assert set(doc["plan"]["layers"]) == {"layers.0", "layers.1", "layers.2"}
    assert all(p in ("keep", "swap", "recompute") for p in doc["plan"]["layers"].values())
    assert doc["plan"]["predicted"]["step_s"] > 0
    assert [p["name"] for p in doc["profile"]] == ["layers.0", "layers.1", "layers.2"]
    assert all(p["act_bytes"] > 0 and p["fwd_s"] > 0 and p["bwd_s"] > 0 for p in doc["profile"])
    assert doc["measured_since_plan"]["steps"] == 1 and doc["measured_since_plan"]["step_s"] > 0


def test_wrong_number_of_per_layer_policies_is_named(make_model_dir, tmp_path):
    model_dir, _ = make_model_dir("llama")
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nv"), cpu_mem="1GiB", activations="keep,swap")
    with pytest.raises(ValueError, match="2 policies for the 3 decoder layers"):
        Engine.from_pretrained(model_dir, cfg)
    with pytest.raises(ValueError, match="--activations must be"):
        EngineConfig(nvme_dir=str(tmp_path / "nv"), activations="offload")


def test_budget_too_small_for_any_policy_names_the_longest_sequence(make_model_dir, tmp_path):
    model_dir, _ = make_model_dir("llama", max_position_embeddings=1 << 20)
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nv"), cpu_mem="64MiB", tokens_per_micro_batch=1 << 19,
                       micro_batch_size=2)
    with pytest.raises(BudgetError, match=r"the longest micro-batch that fits is (\d+) tokens: --seq-len \d+ at --batch-size 2") as e:
        Engine.from_pretrained(model_dir, cfg)
    assert "Whatever the activation policy" in str(e.value)


# ---- the planner on synthetic profiles ---------------------------------------------------
MB = 1 << 20


def _layers(n=8, fwd=1.0, act=100 * MB):
    return [P.LayerProfile(i + 1, fwd, 2 * fwd, act) for i in range(n)]


def test_planner_keeps_everything_that_fits():
    plan = P.choose(_layers(), 1000 * MB, 200 * MB, P.Rates(1e9, 1e9, 1e10), P.Base())
    assert set(plan.policies.values()) == {"keep"}
    assert plan.pool == 0


def test_planner_swaps_when_the_ssd_has_slack_and_recomputes_when_it_does_not():
    fast = P.choose(_layers(), 300 * MB, 200 * MB, P.Rates(2e9, 2e9, 1e10), P.Base())
    assert list(fast.policies.values()).count("keep") == 1  # 100 MB after the 200 MB pool
    assert list(fast.policies.values()).count("swap") == 7
    slow = P.choose(_layers(), 300 * MB, 200 * MB, P.Rates(2e7, 2e7, 1e10), P.Base())
    assert "swap" not in slow.policies.values()
    assert list(slow.policies.values()).count("keep") == 3  # no pool: all 300 MB keep


def test_planner_mixes_swap_and_recompute_at_the_balance_point():
    # Backward: 40 s of compute plus 1 s per recomputed layer, against 38 s of SSD reads plus
    # 0.21 s per swapped layer: the two meet at about 18 swapped layers, the rest recompute.
    layers = _layers(n=20, fwd=1.0, act=100 * MB)
    base = P.Base(read_bwd=19 * 10**9)
    rates = P.Rates(0.5e9, 0.5e9, 1e11)
    plan = P.choose(layers, 200 * MB, 200 * MB, rates, base)
    pols = list(plan.policies.values())
    assert 0 < pols.count("swap") < 20 and pols.count("recompute") > 0
    # ... and the choice is the best of every all-or-fraction alternative
    for k in range(21):
        pol = {p.index: ("swap" if i < k else "recompute") for i, p in enumerate(layers)}
        assert plan.predicted["step_s"] <= P.predict(layers, pol, rates, base)["step_s"] + 1e-9


def _prof(*totals):
    """One two-layer profile per total layer compute (seconds), split 1:2 forward/backward."""
    return [[P.LayerProfile(i, t / 6, t / 3, 10 + i) for i in range(2)] for t in totals]


def test_profile_settles_when_two_steps_agree():
    prof, final = P.settle(_prof(3.0))
    assert not final and prof == _prof(3.0)[0]
    # a step slowed by another process does not settle the profile
    prof, final = P.settle(_prof(3.0, 6.0))
    assert not final and prof == _prof(6.0)[0]
    # two agreeing steps do: their mean per layer
    prof, final = P.settle(_prof(3.0, 6.0, 3.1))
    assert not final
    prof, final = P.settle(_prof(3.0, 6.0, 3.1, 3.0))
    assert final
    assert [p.fwd_s for p in prof] == pytest.approx([3.05 / 6] * 2)
    assert [p.bwd_s for p in prof] == pytest.approx([3.05 / 3] * 2)
    assert [p.act_bytes for p in prof] == [10, 11]


def test_profile_that_never_agrees_takes_the_median():
    prof, final = P.settle(_prof(2.0, 4.0, 8.0, 16.0, 32.0, 64.0), max_steps=6)
    assert final
    assert sum(p.fwd_s + p.bwd_s for p in prof) == pytest.approx(12.0)
    assert not P.settle(_prof(2.0, 4.0, 8.0), max_steps=6)[1]


def test_a_gpu_runs_swap_pool_comes_before_the_state_cache_only_where_it_may_swap():
    # With a GPU, kept activations live in GPU memory; host RAM holds the swapped ones (the pinned
    # pool), taken from the state cache as a CPU run's activations come before it.
    from tierlm.engine.budget_plan import _swap_room
    from tierlm.plan.budget import Split
    s = Split(10 * MB, 0, 2 * MB, 1 * MB, 1 * MB, 0, 1 * MB, state_cache=5 * MB)
    for pol in ("auto", "swap-host", "keep,swap,recompute"):
        got = _swap_room(s, 3 * MB, pol)
        assert (got.activations, got.state_cache) == (3 * MB, 2 * MB), pol
    assert _swap_room(s, 30 * MB, "auto").state_cache == 0
    for pol in ("keep", "recompute", "keep,recompute"):
        assert _swap_room(s, 3 * MB, pol) == s


def test_the_gpu_planning_path_run_on_the_cpu_swaps_to_host_and_keeps_the_bits(make_model_dir, tmp_path, monkeypatch):
    """The planner's GPU branch end to end, on the CPU: the engine taken for a GPU one once built (no
    GPU memory for kept activations, a 25 GB/s host link "measured"), auto re-plans with choose_gpu
    from the profiled step, swaps every layer to host (two copies of a few KiB against a forward),
    records the link in plan.json, and the weights stay torch's bit for bit."""
    from tierlm.engine import act_engine as AE
    monkeypatch.setattr(P, "SETTLE_TOLERANCE", float("inf"))
    init = AE.ActivationPlanner.__init__

    def as_gpu(self, engine, on_event):
        init(self, engine, on_event)
        self.on_gpu, self.allowance = True, 0
    monkeypatch.setattr(AE.ActivationPlanner, "__init__", as_gpu)
    monkeypatch.setattr(AE, "measure_link", lambda device, nbytes: (25e9, 24e9))
    chose, real = [], P.choose_gpu
    monkeypatch.setattr(P, "choose_gpu", lambda *a, **k: chose.append(a) or real(*a, **k))
    model_dir, model = make_model_dir("llama")
    data = batches(8, seq=16)
    _, ref_masters, ref_losses, _ = run_reference(model, data, **HP)
    masters, _, losses, _ = run_engine(model_dir, tmp_path, data, activations="auto", **HP)
    assert losses == ref_losses
    for n, m in ref_masters.items():
        assert torch.equal(masters[n], m), n
    doc = _plan(tmp_path, "auto")
    assert chose and doc["rates"]["d2h"] == 25e9 and doc["rates"]["h2d"] == 24e9
    assert set(doc["plan"]["layers"].values()) == {"swap-host"}
    assert doc["steps"][-1]["swapped_bytes"]["host"] > 0


def test_a_gpu_plan_gives_the_swap_room_it_leaves_unused_back_to_the_state_cache():
    from types import SimpleNamespace

    from tierlm.engine.act_engine import ActivationPlanner
    from tierlm.storage import HostBufferPool
    cache = HostBufferPool(100 * MB, name="cache")
    acts = SimpleNamespace(eng=SimpleNamespace(cache_pool=cache), host_allowance=40 * MB)
    ActivationPlanner._give_back(acts, 15 * MB)   # the plan swaps 15 MB to host
    assert (cache.capacity, acts.host_allowance) == (125 * MB, 15 * MB)
    ActivationPlanner._give_back(acts, 15 * MB)   # a later plan: nothing more to give
    assert (cache.capacity, acts.host_allowance) == (125 * MB, 15 * MB)
    acts.eng.cache_pool = None                    # no state cache: the room stays
    ActivationPlanner._give_back(acts, 0)
    assert acts.host_allowance == 15 * MB
