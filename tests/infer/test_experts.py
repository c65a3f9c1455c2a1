"""A mixture of experts' streamed experts: decode reads only the experts the router picks, through an
expert cache in RAM, and computes what the resident model computes."""
from concurrent.futures import Future

import pytest
import torch

from tierlm.hf.init import init_model
from tierlm.infer import engine as engine_mod
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.experts import ExpertCache, Part
from tierlm.plan.expert_placement import plan_expert_placement
from tierlm.storage import BudgetError

from ..families import family_config
from ..memory import held_now

PROMPTS = [[5, 9, 17, 3, 44, 2, 80], [7, 1, 99]]
STEPS = 6


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    cfg = family_config("qwen3_moe", vocab_size=300, initializer_range=0.3, num_hidden_layers=3,
                        num_experts=16, num_experts_per_tok=4)
    return init_model(tmp_path_factory.mktemp("moe") / "m", cfg, seed=3)


def _decode(d, tmp_path, resident, tag, **cfg):
    """Greedy decode of two rows; (logits of each step, the engine's expert stats, the store keys
    read, the (layer, expert) pairs the routers picked)."""
    eng = InferenceEngine(d, InferConfig(cpu_mem="1GiB", dtype="fp32", max_batch=2, max_seq_len=32,
                                         resident_layers=resident, nvme_dir=str(tmp_path / tag), **cfg),
                          library_rss=held_now())
    read, routed = [], set()
    try:
        for i, moe in eng.moe.items():
            for _, mod, _ in moe.modules:
                def note(m, args, kwargs, i=i):
                    idx = next(v for v in list(args) + list(kwargs.values())
                               if isinstance(v, torch.Tensor) and not v.is_floating_point())
                    routed.update((i, e) for e in idx.unique().tolist())
                mod.register_forward_pre_hook(note, with_kwargs=True)
        if eng.store is not None:
            inner = eng.store.store.read_into
            eng.store.store.read_into = lambda key, *a, **k: (read.append(key), inner(key, *a, **k))[1]
        out = [eng.step([list(p) for p in PROMPTS], [0, 0])]
        for t in range(STEPS):
            nxt = out[-1].argmax(-1).tolist()
            out.append(eng.step([[n] for n in nxt], [len(p) + t for p in PROMPTS]))
        return torch.stack(out), eng.expert_stats(), read, routed, eng
    finally:
        eng.close()


def test_streamed_experts_compute_what_resident_ones_do_reading_only_routed_experts(moe_dir, tmp_path):
    ref, none, _, routed_ref, _ = _decode(moe_dir, tmp_path, None, "resident")
    assert none is None  # it fits: nothing streams
    got, stats, read, routed, eng = _decode(moe_dir, tmp_path, 0, "streamed")
    assert eng.expert_placement is not None and eng.placement.resident == 0
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # the family's eager loop against its grouped product: the same sums within fp32 rounding
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert routed == routed_ref
    # each routed (layer, expert) read once (the cache holds every expert here), and nothing else
    experts = [k for k in read if "#e" in k]
    per_expert = len(eng.streamed_experts.cache.parts)
    assert len(experts) == len(set(experts)) == per_expert * len(routed)
    names = {(i, f"{q}.{a}") for i, m in eng.moe.items() for q, _, attrs in m.modules for a in attrs}
    assert {k for k in experts} == {f"{n}#e{e}" for i, n in names for (j, e) in routed if j == i}
    assert stats.requests == stats.hits + len(routed)
    assert stats.miss_bytes == len(routed) * eng.streamed_experts.cache.slot_bytes


def test_gemma4s_experts_beside_its_dense_mlp_stream_as_resident_ones_compute(tmp_path):
    """Gemma 4 (26B-A4B shape): every layer runs a dense MLP and routed experts side by side, the
    router on the layer's input, its layers of two head dims. Streamed through the expert cache,
    the same logits bit for bit as resident, the same experts routed."""
    cfg = family_config("gemma4_text", vocab_size=300, initializer_range=0.02, num_hidden_layers=4,
                        layer_types=["sliding_attention", "full_attention"] * 2, num_experts=16, top_k_experts=4)
    d = init_model(tmp_path / "m", cfg, seed=3)
    ref, _, _, routed_ref, _ = _decode(d, tmp_path, None, "resident")
    got, stats, _, routed, eng = _decode(d, tmp_path, 0, "streamed")
    assert eng.expert_placement is not None and len(eng.moe) == 4
    assert torch.equal(got, ref) and routed == routed_ref
    assert stats.hits < stats.requests


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_a_cache_of_one_layers_experts_evicts_and_computes_the_same(moe_dir, tmp_path, monkeypatch, policy):
    ref, _, _, _, _ = _decode(moe_dir, tmp_path, None, "resident")

    def one_layer(*a, **k):  # the least cache the placement allows: one layer's experts
        p = plan_expert_placement(*a, **k)
        p.cache = p.experts * p.slot_bytes
        return p
    monkeypatch.setattr(engine_mod, "plan_expert_placement", one_layer)
    got, stats, read, routed, eng = _decode(moe_dir, tmp_path, 0, f"small-{policy}", expert_policy=policy)
    assert eng.streamed_experts.cache.slots == 16
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert stats.hits < stats.requests and len([k for k in read if "#e" in k]) > len(routed)


class _Store:
    def __init__(self):
        self.reads = []

    def read_into(self, key, out, owns_padding=False):
        self.reads.append(key)
        out.fill_(float(hash(key) % 97))
        f = Future()
        f.set_result(out)
        return f


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_the_cache_evicts_by_its_policy_and_never_a_pinned_expert(policy):
    store = _Store()
    parts = [Part("w", "", torch.float32, (4, 4))]
    c = ExpertCache(store, lambda i, p, e: f"{i}.{p.attr}#e{e}", parts, capacity=3 * 4096, experts=2, policy=policy)
    assert c.slots == 3
    for e in (0, 0, 0, 1):      # expert 0 often, expert 1 once, then 2 most recently
        c.release(0, list(c.acquire(0, [e])[0]))
    c.release(0, list(c.acquire(0, [2])[0]))
    c.acquire(0, [1])            # pinned: in use by this step
    c.acquire(0, [3])            # a miss with every slot taken: the victim is neither pinned nor ...
    evicted = {0, 1, 2} - {e for (_, e) in c.where}
    assert evicted == ({2} if policy == "lfu" else {0})  # ... frequent (lfu) / recent (lru)
    assert c.views(c.where[(0, 3)])[0].eq(float(hash("0.w#e3") % 97)).all()
    with pytest.raises(ValueError, match="routes to up to 4"):
        ExpertCache(store, lambda *a: "", parts, capacity=3 * 4096, experts=4)


class _SlowStore:
    """Reads land when the test says so (the order they were asked for is recorded)."""

    def __init__(self):
        self.asked, self.futs = [], {}

    def read_into(self, key, out, owns_padding=False):
        self.asked.append(key)
        self.futs[key] = f = Future()
        return f


def test_misses_are_read_in_the_loops_order_and_waited_for_one_at_a_time():
    store = _SlowStore()
    parts = [Part("w", "", torch.float32, (4, 4)), Part("b", "", torch.float32, (4,))]
    c = ExpertCache(store, lambda i, p, e: f"{i}.{p.attr}#e{e}", parts, capacity=4 * 8192, experts=3)
    got, pending = c.acquire(0, [0])
    store.futs["0.w#e0"].set_result(None)
    store.futs["0.b#e0"].set_result(None)
    c.land(0, 0, pending[0])
    c.release(0, list(got))
    store.asked.clear()
    got, pending = c.acquire(0, [0, 2, 5])           # 0 is a hit: nothing to wait for
    assert sorted(got) == [0, 2, 5] and list(pending) == [2, 5]
    assert store.asked == ["0.w#e2", "0.b#e2", "0.w#e5", "0.b#e5"]   # the order the experts compute in
    for k in ("0.w#e2", "0.b#e2"):
        store.futs[k].set_result(None)
    c.land(0, 2, pending[2])                         # expert 2 computes while 5 is still on the drive
    assert not store.futs["0.w#e5"].done()
    store.futs["0.w#e5"].set_exception(OSError("drive gone"))
    store.futs["0.b#e5"].set_result(None)
    with pytest.raises(OSError, match="drive gone"):
        c.land(0, 5, pending[5])
    assert (0, 5) not in c.where and (0, 5) not in c.pinned   # its slot no longer claims it
    c.release(0, [0, 2])
    assert (0, 2) in c.where and not c.pinned and not c.inflight


def test_reads_left_in_flight_by_a_failed_step_land_before_their_slots_are_reused():
    store = _SlowStore()
    parts = [Part("w", "", torch.float32, (4, 4))]
    c = ExpertCache(store, lambda i, p, e: f"{i}.{p.attr}#e{e}", parts, capacity=2 * 4096, experts=2)
    c.acquire(0, [0, 1])                             # the step raised before waiting for either
    store.futs["0.w#e0"].set_result(None)
    store.futs["0.w#e1"].set_exception(OSError("bad sector"))
    c.release(0, [0, 1])                             # settles both: 1's slot is given back
    assert (0, 0) in c.where and (0, 1) not in c.where and not c.inflight and len(c.free) == 1


def test_a_budget_without_room_for_one_layers_experts_is_refused_with_the_fix():
    cfg = InferConfig(cpu_mem="100MiB")
    with pytest.raises(BudgetError, match=r"an expert cache of one layer's 128 experts .*Raise --cpu-mem"):
        plan_expert_placement(cfg, 10 << 20, 10 << 20, 1 << 20, 8, 1 << 20, 1 << 20, (1 << 20, 128, 8))
    p = plan_expert_placement(InferConfig(cpu_mem="400MiB"), 10 << 20, 10 << 20, 1 << 20, 8, 1 << 20, 1 << 20,
                              (1 << 20, 128, 8))
    assert p.placement.resident == 8 and p.placement.window == 0   # dense parts first
    assert p.slots == (400 - 10 - 10 - 8 - 1 - 1)                  # then the cache, in whole experts


def _dequantised_reference(d, mode="int8"):
    """The model with each decoder layer's linear maps and each expert's matrices replaced by what
    int8 keeps of them (round(w / scale) * scale, a scale per output row): what --weights int8
    computes with, in fp32."""
    from transformers import AutoModelForCausalLM

    from tierlm.hf.structure import find_layers
    from tierlm.infer.quant import QLinear, quantizable

    def deq(w):
        q = QLinear(w.shape[1], w.shape[0], mode).quantize(w, None, torch.float32)
        return q["qweight"].float() * q["scales"][:, None]
    model = AutoModelForCausalLM.from_pretrained(d).float().eval()
    with torch.no_grad():
        for layer in find_layers(model)[1]:
            for mod, _ in quantizable(layer, mode).values():
                mod.weight.copy_(deq(mod.weight))
            for name, p in layer.named_parameters():
                if ".experts." in name and p.dim() == 3:
                    for e in range(p.shape[0]):
                        p[e].copy_(deq(p[e]))
    return model


def test_int8_experts_compute_with_their_quantised_weights(moe_dir, tmp_path):
    ref = _dequantised_reference(moe_dir)
    eng = InferenceEngine(moe_dir, InferConfig(cpu_mem="1GiB", dtype="fp32", weights="int8", max_batch=1,
                                               max_seq_len=32, nvme_dir=str(tmp_path / "q8")), library_rss=held_now())
    try:
        assert eng.expert_placement is not None  # quantised experts always go by expert
        assert {(p.kind, p.dtype) for p in eng.expert_parts} == {("qweight", torch.int8), ("scales", torch.float32)}
        got = eng.step([PROMPTS[0]], [0])[0]
    finally:
        eng.close()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPTS[0]])).logits[0, -1]
    # one-row int8 products round x to 16 bits a row: far inside this
    assert (got - want).abs().max().item() <= 2e-3 * want.abs().max().item()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_experts_give_the_same_bits_whatever_the_cache_holds(moe_dir, tmp_path, monkeypatch, weights):
    full, _, _, _, _ = _decode(moe_dir, tmp_path, None, f"{weights}-full", weights=weights)

    def one_layer(*a, **k):
        p = plan_expert_placement(*a, **k)
        p.cache = p.experts * p.slot_bytes
        return p
    monkeypatch.setattr(engine_mod, "plan_expert_placement", one_layer)
    small, stats, _, _, _ = _decode(moe_dir, tmp_path, None, f"{weights}-small", weights=weights)
    assert stats.hits < stats.requests
    assert torch.equal(full, small)
