"""Models whose layers keep recurrent states (state-space, linear attention, short convolutions,
and hybrids of them with attention) through tierlm's inference engine: greedy decoding equals
transformers' generate, resident and streamed, with rows joining, leaving and moving between
slots, prompts fed in chunks where the family's layers continue a prompt from their state, and
whole where they cannot (Mamba)."""
import pytest
import torch

from tests.infer.test_generate import PROMPTS, _Tok, _engine, _reference
from tierlm.hf.fields import shrunk
from tierlm.infer.batcher import Batcher, Request
from tierlm.infer.sampling import SamplingParams
from tierlm.storage import BudgetError
from tierlm.units import fmt_bytes

from ..memory import held_now

# what sets each apart: Gated DeltaNet beside gated attention (and experts), OLMo's linear
# attention, LFM2's short convolutions, Mamba (prompts whole), Mamba-2, Jamba's Mamba + attention +
# experts, Falcon-H1's attention and Mamba side by side in one layer, Kimi's three convolutions a layer,
# Nemotron-H's layers that keep nothing, Granite 4's Mamba-2 + attention + experts, LARA's fused input
# projections
STATE_FAMILIES = {
    "qwen3_next": {},
    "qwen3_5_text": {},
    "olmo_hybrid": {},
    "lfm2": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]),
    "mamba": {},
    "mamba2": dict(hidden_size=64, num_heads=4, head_dim=16, expand=1, n_groups=2, state_size=16),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2),
    "falcon_h1": {},
    "kimi_linear": {},
    "nemotron_h": {},  # Mamba-2, attention, MLP-only and expert layers, each a layer of its own
    # Gated DeltaNet beside sliding and full attention; its four input projections cut from one
    # fused file tensor (hf.split_tensors)
    # Granite 4's hybrid: Mamba-2 layers beside attention, experts with a shared MLP in each
    "granitemoehybrid": dict(hidden_size=64, num_hidden_layers=2, layer_types=["mamba", "attention"],
                             mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16,
                             num_local_experts=4, num_experts_per_tok=2),
    "lara_mini": dict(num_hidden_layers=3, layer_types=["linear_attention", "sliding_attention", "full_attention"],
                      sliding_window=4),
    # Inkling: every layer attends (sliding or full, by its own type names hybrid_sliding / hybrid,
    # masks made for both) through short convolutions over keys and values (conv states), with
    # relative positions from the cache's query offset (rows grouped by start: reads_offset)
    "inkling_text": dict(num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"], sliding_window=4,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                         swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16),
    # Zamba: Mamba layers, and hybrid ones that all run one shared attention block (no layer of its
    # own: handed the layer at each call, its KV layers are those the meta forward stored for)
    "zamba": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  attention_hidden_size=128, attention_head_dim=32, mamba_dt_rank=4, intermediate_size=96,
                  layers_block_type=["linear_attention", "linear_attention", "hybrid", "hybrid"]),
    # Zamba2: Mamba-2 layers, and hybrid ones running two shared blocks in turn, each with its own
    # adapters per layer; its widths come from hidden_size (hf.fields.rederive)
    "zamba2": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                   n_mamba_heads=8, mamba_d_state=16, mamba_ngroups=1, intermediate_size=96, chunk_size=16,
                   num_mem_blocks=2, use_shared_attention_adapter=True,
                   layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"]),
}
WHOLE_PROMPTS = {"mamba", "jamba", "zamba", "zamba2"}  # their Mamba layers restart a prompt from zero


def state_config(fam):
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(fam, **STATE_FAMILIES[fam])
    cfg = cfg if fam in ("zamba", "zamba2") else shrunk(cfg, layers=2, every_kind=True)  # (given small: two hybrids)
    cfg.initializer_range = 0.3  # peaked, varied next tokens, so a mismatch changes tokens
    return cfg


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    made = {}

    def get(fam):
        if fam not in made:
            from transformers import AutoModelForCausalLM
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(state_config(fam)).float().eval()
            d = tmp_path_factory.mktemp(fam) / "model"
            model.save_pretrained(d)
            made[fam] = (d, model)
        return made[fam]
    return get


def _run(eng, prompts, max_tokens, step_tokens=None):
    b = Batcher(eng, _Tok(), [])
    if step_tokens:
        b.step_tokens = step_tokens
    reqs = [b.submit(Request(list(p), SamplingParams(max_tokens=n))) for p, n in zip(prompts, max_tokens)]
    b.run_until_idle()
    return [r.out_ids for r in reqs]


@pytest.mark.parametrize("fam", list(STATE_FAMILIES))
def test_greedy_equals_transformers(fam, state_dir, tmp_path):
    d, model = state_dir(fam)
    # the first finishes first: the second moves into its slot, states and all, and the third
    # takes the second's; prompts of 5, 2 and 11 tokens
    new = [2, 6, 6]
    refs = [_reference(model, p, n) for p, n in zip(PROMPTS, new)]
    assert len({tuple(r) for r in refs}) > 1
    with torch.no_grad():
        ref_next = model(torch.tensor([PROMPTS[2]])).logits[0, -1]
    for resident in (None, 0):
        eng = _engine(d, tmp_path, cpu_mem="4GiB", max_batch=2, max_seq_len=40, resident_layers=resident)
        try:
            assert eng.cache.states is not None and eng.generic.states
            assert eng.whole_prompts == (fam in WHOLE_PROMPTS)
            if resident == 0:
                assert eng.stream is not None and eng.placement.streamed == eng.placement.layers
            # keys and values only where a layer attends
            assert sum(k is not None for k in eng.cache.k) == len(eng.kv_layers) < len(eng.cache.k) or \
                fam in ("falcon_h1", "inkling_text")
            torch.testing.assert_close(eng.step([PROMPTS[2]], [0])[0], ref_next, atol=1e-3, rtol=1e-4)
            # prompts in chunks of 2 tokens a step (one step each where the family cannot continue one)
            assert _run(eng, PROMPTS, new, step_tokens=None if fam in WHOLE_PROMPTS else 2) == refs, \
                f"{fam}, resident_layers={resident}"
            assert _run(eng, PROMPTS[::-1], new) == [_reference(model, p, n) for p, n in zip(PROMPTS[::-1], new)]
        finally:
            eng.close()


def test_a_prompt_longer_than_a_step_is_refused_where_it_cannot_go_in_chunks(state_dir, tmp_path):
    d, _ = state_dir("mamba")
    eng = _engine(d, tmp_path, cpu_mem="4GiB", max_batch=2, max_seq_len=40, step_tokens=8)
    try:
        with pytest.raises(BudgetError, match=r"prompt of 11 tokens: mamba's layers cannot continue a prompt fed in chunks .*"
                                              r"--step-tokens to 11"):
            Batcher(eng, _Tok(), []).submit(Request(PROMPTS[2], SamplingParams(max_tokens=2)))
    finally:
        eng.close()


def test_the_states_are_in_the_budget(state_dir, tmp_path):
    """The states' bytes are planned beside the KV cache (which hybrids keep for their attention
    layers only)."""
    from tierlm.infer.kvcache import kv_bytes
    from tierlm.infer.states import StateSlots
    d, model = state_dir("qwen3_next")
    eng = _engine(d, tmp_path, cpu_mem="4GiB", max_batch=3, max_seq_len=40)
    try:
        st = eng.cache.states
        assert st.nbytes == StateSlots.bytes_for(eng.state_shapes, 3, torch.float32) > 0
        assert eng.cache.nbytes == st.nbytes + kv_bytes(model.config, 3, 40, torch.float32, eng.kv_layers)
        assert {s.layer for s in eng.state_shapes} | eng.kv_layers == set(range(model.config.num_hidden_layers))
        assert f"+ KV cache and recurrent states {fmt_bytes(eng.placement.kv)} +" in eng.placement.describe()
    finally:
        eng.close()


def test_a_model_without_attention_keeps_recurrent_states_not_a_kv_cache(state_dir, tmp_path):
    """The placement line and a refused budget name what the cache holds: Mamba's conv and
    recurrent states, no keys and values."""
    d, _ = state_dir("mamba")
    eng = _engine(d, tmp_path, cpu_mem="4GiB", max_batch=2, max_seq_len=40)
    try:
        assert "recurrent states" in eng.placement.describe() and "KV cache" not in eng.placement.describe()
    finally:
        eng.close()
    with pytest.raises(BudgetError, match=r"embeddings and head .*, recurrent states .* for --max-batch"):
        _engine(d, tmp_path, cpu_mem="1MiB", max_batch=2, max_seq_len=40)


def test_the_check_sees_a_state_not_continued(monkeypatch, state_dir):
    """A cache that dropped the kept conv state between steps is caught by the load-time check: the
    model then generates on its own cache (the check's last mode), and the engine says why."""
    from tierlm.infer import generic
    from tierlm.infer.kvcache import SlotKVCache
    _, model = state_dir("qwen3_next")
    monkeypatch.setattr(generic, "_CHECKS", {})
    assert generic.check(model) is None
    monkeypatch.setattr(generic, "_CHECKS", {})
    monkeypatch.setattr(SlotKVCache, "get_recurrent_state", lambda self, layer_idx, state_idx=0: None)
    assert generic.check(model) is None and generic.mask_mode(model) == "cache"
    assert "differ from transformers'" in generic.engine_failure(model)


@pytest.mark.parametrize("fam", ["qwen3_5_text", "mamba"])
def test_the_device_schedule_keeps_states_on_its_device(fam, state_dir, tmp_path):
    """The GPU's schedule (run on the CPU here): states live beside the KV cache on the device, and
    greedy decoding is transformers' still."""
    d, model = state_dir(fam)
    new = [4, 6, 5]
    refs = [_reference(model, p, n) for p, n in zip(PROMPTS, new)]
    eng = _engine(d, tmp_path, cpu_mem="4GiB", max_batch=2, max_seq_len=40, device_schedule=True, gpu_mem="1GiB",
                  resident_layers=1, host_resident_layers=1)
    try:
        assert eng.dev is not None and eng.cache.states is not None
        assert _run(eng, PROMPTS, new) == refs
    finally:
        eng.close()


def _whole_forwards(model, prompt, new):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_hybrids_copy_without_attention_layers_generates(tmp_path):
    """Qwen3.5's first two layers alone (`tierlm init --arch qwen3_5_text --layers 2`): both linear
    attention. transformers then makes the (unread) full-attention mask from the cache itself; its
    own generate fails there (its cache has no attention layer to count positions by), so the
    reference is greedy over whole forwards."""
    from transformers import AutoModelForCausalLM
    from tierlm.hf.presets import make_config
    torch.manual_seed(0)
    cfg = make_config("qwen3_5_text", None, {"layers": 2, "initializer_range": 0.3})
    assert set(cfg.layer_types) == {"linear_attention"}
    assert "full_attention" in make_config("qwen3_5_text").layer_types  # init's own tiny copy attends
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(tmp_path / "m")
    eng = _engine(tmp_path / "m", tmp_path, cpu_mem="4GiB", max_batch=2, max_seq_len=40)
    try:
        assert eng.kv_layers == set() and eng.cache.nbytes == eng.cache.states.nbytes
        assert _run(eng, PROMPTS, [3, 4, 3]) == [_whole_forwards(model, p, n) for p, n in zip(PROMPTS, [3, 4, 3])]
    finally:
        eng.close()
