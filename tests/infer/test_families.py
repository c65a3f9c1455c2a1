"""Every decoder family of tests/families.py through tierlm's inference engine: greedy decoding
equals transformers' generate (fp32; resident, streamed, batched), logits equal the model's own
(what a family does after its head included), bf16, int8 and int4 weights run, and the engine
says which decode path runs."""
import pytest
import torch

from tests.families import FAMILIES, family_config
from tests.infer.test_generate import PROMPTS, _engine, _greedy, _reference
from tierlm.hf.meta_forward import cache_kwarg
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.model_cache import returned_cache
from ..memory import held_now

NEW = 6


# JetMoE's int8 holds only its kv_proj in int8 (its experts are stacked tensors, its routers stay
# in bf16), yet moves the logits 0.31: that one rounding changes which attention and MLP experts
# the next tokens route to, a discrete jump of the tiny model (its bf16 distance: 0.05)
# dots3-note's tiny model: its own fp32 forward with int8-rounded weights is 0.24 from fp32 on this
# prompt (0.6 on another; its indexer's top-4 and routing jump): tierlm's int8 measured 0.256
INT8_TOL = {"jetmoe": 0.4, "dots3_note_text": 0.3}

# families whose transformers forward over a cache differs from its forward over the whole
# sequence: dots3-note's tiny model by 0.28 after one decode step, in transformers alone (its
# second layer); tierlm's step equals the cached one, which transformers.generate runs, exactly
DECODES_AS_CACHED = {"dots3_note_text"}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """family -> (model directory, the fp32 model it holds), each made once for the module."""
    made = {}

    def get(fam):
        if fam not in made:
            from transformers import AutoModelForCausalLM
            torch.manual_seed(0)
            # a wide init: peaked, varied next tokens, so a mismatch changes tokens
            model = AutoModelForCausalLM.from_config(family_config(fam, initializer_range=0.3)).float().eval()
            d = tmp_path_factory.mktemp(fam) / "model"
            model.save_pretrained(d)
            made[fam] = (d, model)
        return made[fam]
    return get


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_greedy_and_logits_equal_transformers(fam, family_dir, tmp_path):
    d, model = family_dir(fam)
    refs = [_reference(model, p, NEW) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) > 1  # prompts lead to different tokens: a real test
    ids = torch.tensor([list(range(3, 15)), list(range(40, 52))])  # 12 > the sliding windows of 6
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref_next = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
        ref_after = model(torch.tensor([PROMPTS[0] + [7]])).logits[0, -1]  # one decode step on
        if fam in DECODES_AS_CACHED:
            first = model(torch.tensor([PROMPTS[0]]), use_cache=True)
            ref_after = model(torch.tensor([[7]]), use_cache=True, **{cache_kwarg(model): returned_cache(first)}).logits[0, -1]
    for resident in (None, 0):
        eng = _engine(d, tmp_path, max_batch=3, max_seq_len=40, resident_layers=resident)
        try:
            if resident == 0:
                assert eng.placement.streamed == eng.placement.layers
            path = eng.decode_path()
            want = "decode: native (" if eng.lean is not None else "decode: generic (transformers' modules: "
            assert eng.describe().endswith(path) and path.startswith(want), path
            # the next-token logits a sampler sees (prefill, then a decode step: the native path's
            # where it runs), and perplexity's: the model's own
            torch.testing.assert_close(eng.step([PROMPTS[0]], [0])[0], ref_next, atol=1e-3, rtol=1e-4)
            torch.testing.assert_close(eng.step([[7]], [len(PROMPTS[0])])[0], ref_after, atol=1e-3, rtol=1e-4)
            assert _greedy(eng, PROMPTS, NEW) == refs, f"{fam}, resident_layers={resident}, batched"
            if resident is None:
                torch.testing.assert_close(eng.logits_all(ids), ref_logits, atol=1e-3, rtol=1e-4)
                assert _greedy(eng, [PROMPTS[2]], NEW) == [refs[2]], f"{fam}, one row"
        finally:
            eng.close()


def test_gemma4_per_layer_embeddings_and_shared_keys_generate_like_transformers(tmp_path):
    """Gemma 4's small shapes (E2B, E4B): per-layer embeddings looked up and projected before the
    layers and fed to each one, its last layers attending with an earlier layer's keys and values
    (they cache none of their own) and a doubled MLP there. Generating runs the model's own forward,
    so greedy tokens equal transformers', resident and streamed, batched rows of different lengths.
    (Fine-tuning such a model is refused: tests/engine/test_architectures.py.)"""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = family_config("gemma4_text", initializer_range=0.02, num_hidden_layers=4, num_kv_shared_layers=2,
                        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
                        vocab_size_per_layer_input=128, use_double_wide_mlp=True, enable_moe_block=False)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    assert model.model.layers[3].self_attn.is_kv_shared_layer and model.model.embed_tokens_per_layer is not None
    _greedy_equal_resident_and_streamed(model, tmp_path)


def _greedy_equal_resident_and_streamed(model, tmp_path, decode_path: str = ""):
    """`model` saved; greedy tokens of batched prompts of different lengths equal transformers'
    generate, every layer resident and every layer streamed; the decode path says `decode_path`."""
    model.save_pretrained(tmp_path / "model")
    refs = [_reference(model, p, NEW) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) > 1
    for resident in (None, 0):
        eng = _engine(tmp_path / "model", tmp_path, max_batch=3, max_seq_len=40, resident_layers=resident)
        try:
            assert decode_path in eng.decode_path()
            assert _greedy(eng, PROMPTS, NEW) == refs, f"resident_layers={resident}"
        finally:
            eng.close()


def test_layers_over_every_earlier_blocks_output_generate_on_the_models_own_cache(tmp_path):
    """Inkling 2's masks read the cache's own attributes (`is_sliding`), which tierlm's slot cache
    has not: the load-time check finds the engine's cache fails and the model's own passes, so each
    sequence keeps the cache its forward makes. Greedy tokens equal transformers', resident and
    streamed, batched rows of different lengths; its routers stay fp32 in a bf16 model (as
    transformers loads it), where the meta forward that sizes its states used to cast them."""
    from transformers import AutoModelForCausalLM
    from tests.families import inkling2_config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(inkling2_config(initializer_range=0.3)).float().eval()
    _greedy_equal_resident_and_streamed(model, tmp_path, decode_path="keeps the cache the model makes")
    eng = InferenceEngine(tmp_path / "model", InferConfig(dtype="bf16", cpu_mem="1GiB", max_batch=2, max_seq_len=40),
                          library_rss=held_now())
    try:
        assert all(layer.mlp.gate.weight.dtype == torch.float32 for layer in eng.model.model.layers)
        assert len(_greedy(eng, PROMPTS[:2], NEW)[0]) == NEW
    finally:
        eng.close()


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_bf16_int8_int4_run(fam, family_dir, tmp_path):
    """bf16 and int8 weights (fused qkv, Conv1D, biases quantised) stay near fp32's logits, int4
    runs; int8 streamed, so quantised pieces go through the store too."""
    import copy
    d, model = family_dir(fam)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
        own_bf16_logits = copy.deepcopy(model).to(torch.bfloat16)(torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    own_bf16 = _rel(own_bf16_logits, ref)
    # relative distances to fp32's logits measured 0.008-0.03 (bf16), 0.02-0.06 (int8); int4's
    # 0.2-0.9 at this init say little, so int4 only has to run. Where transformers' own bf16 model
    # is farther from fp32 (GLM-4 0.16, GraniteMoeShared 0.20 at this init), bf16 may be as far,
    # and int8 (which computes in bf16) is held to its distance from that bf16 model's logits where
    # nearer (LongCat-Flash with transformers 5.25: own bf16 0.66 from fp32, int8 0.035 from it)
    bf16_tol = max(0.1, 1.25 * own_bf16)
    for weights, tol, resident in (("bf16", bf16_tol, None), ("int8", INT8_TOL.get(fam, 0.15), 0),
                                   ("int4", None, None)):
        eng = InferenceEngine(d, InferConfig(cpu_mem="1GiB", weights=weights, max_batch=3, max_seq_len=40,
                                             resident_layers=resident, nvme_dir=str(tmp_path / "nvme")),
                              library_rss=held_now())
        try:
            assert eng.dtype == torch.bfloat16 and (resident is None or eng.stream is not None)
            logits = eng.step([PROMPTS[0]], [0])[0]
            assert torch.isfinite(logits).all()
            far = _rel(logits, ref) if weights != "int8" else min(_rel(logits, ref), _rel(logits, own_bf16_logits))
            assert tol is None or far < tol, f"{fam} {weights}: {far:.3f}"
            out = _greedy(eng, PROMPTS, 3)
            assert all(len(o) == 3 and all(0 <= t < model.config.vocab_size for t in o) for o in out)
        finally:
            eng.close()


@pytest.mark.parametrize("arch,kw", [
    ("rwkv", dict(hidden_size=32, num_hidden_layers=2, vocab_size=64, attention_hidden_size=32,
                  intermediate_size=64, context_length=32)),
])
def test_models_without_a_kv_cache_are_refused(arch, kw, tmp_path):
    """RWKV carries a state object of its own, not transformers' conv and recurrent states (which
    tests/infer/test_states.py runs)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw)).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="keep no KV cache .*and no state through transformers' cache .*RWKV"):
        InferenceEngine(tmp_path / "m", InferConfig(dtype="fp32", nvme_dir=str(tmp_path / "n")), library_rss=held_now())


def test_attention_writing_fewer_kv_heads_than_its_config_says(tmp_path):
    """Falcon's multi-query attention writes one key/value head where its config says four: the
    cache holds what the attention writes (batched rows read every head of it)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = family_config("falcon", initializer_range=0.3, new_decoder_architecture=False, multi_query=True)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(tmp_path / "m")
    refs = [_reference(model, p, NEW) for p in PROMPTS]
    eng = _engine(tmp_path / "m", tmp_path, max_batch=3, max_seq_len=40)
    try:
        assert _greedy(eng, PROMPTS, NEW) == refs
        assert eng.cache.k[0].shape[1] == 1
    finally:
        eng.close()


@pytest.mark.parametrize("fam,masks", [("falcon-rw", "own"), ("bloom", "layers"), ("llama", "engine")])
def test_alibi_families_run_the_masks_the_check_chose(fam, masks, tmp_path):
    """BLOOM's and Falcon-RW's forwards build their ALiBi biases from a 2-D padding mask, which the
    engine's 4-D masks are not: the check on a small copy finds the engine's masks wrong. BLOOM's
    layers take the engine's masks once its forward has built its biases from a 2-D mask of the
    keys ("layers": rows at any positions together); Falcon-RW folds its biases into the mask its
    forward makes, so it makes its own ("own": rows of one start together). Greedy decoding equals
    transformers' generate (Falcon-RW's under its default SDPA: its eager attention adds the biases
    twice), batched and streamed. A family the engine's masks serve keeps them."""
    from transformers import AutoModelForCausalLM
    cfg = family_config("falcon", alibi=True, new_decoder_architecture=False, multi_query=True,
                        initializer_range=0.3) if fam == "falcon-rw" else family_config(fam, initializer_range=0.3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(tmp_path / "m")
    refs = [_reference(model, p, NEW) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) > 1
    for resident in (None, 0):
        eng = _engine(tmp_path / "m", tmp_path, max_batch=3, max_seq_len=40, resident_layers=resident)
        try:
            assert eng.generic.masks == masks
            if masks != "engine":
                assert not eng.generic.packs and "decode: generic" in eng.decode_path()
                # rows at different positions: one forward each where the model makes its masks
                together = [(0, 3)] if masks == "layers" else [(0, 1), (1, 2), (2, 3)]
                assert eng.generic.groups([[1], [2], [3]], [4, 7, 4]) == together
                assert eng.generic.groups([[1, 2], [3]], [0, 0]) == [(0, 2)]
            assert _greedy(eng, PROMPTS, NEW) == refs, f"resident_layers={resident}"
        finally:
            eng.close()


def test_the_check_sees_a_wrong_mask(monkeypatch):
    """The small copy's check compares logits, so a path that, say, forgot a sliding window (as
    the engine once did for Starcoder2) is caught: the model's own masks are taken, or, where they
    too are wrong, the model refused."""
    from tierlm.hf.structure import empty_model
    from tierlm.infer import generic
    model = empty_model(family_config("starcoder2"))
    monkeypatch.setattr(generic, "_CHECKS", {})
    assert generic.check(model) is None
    monkeypatch.setattr(generic, "_CHECKS", {})
    monkeypatch.setattr(generic, "sliding_window", lambda config: (None, False))
    # the model's own masks (the fallback ALiBi families need) are right: taken, and said
    assert generic.check(model) is None and generic.mask_mode(model) != "engine"
    monkeypatch.setattr(generic, "_CHECKS", {})
    compare = generic._compare
    monkeypatch.setattr(generic, "_compare", lambda *a, masks, **kw: compare(*a, masks="engine", **kw))
    assert "differ from transformers'" in generic.check(model)


def test_chunked_attention_and_position_scaled_queries(tmp_path):
    """Llama 4's text model: chunked attention layers (a query sees its own chunk of 4 positions)
    beside full ones, and queries of its no-rotary layers scaled by position, from the cache's
    length (floor_scale 2: every position changes the scale). Greedy decoding equals transformers'
    generate, batched (rows at different positions run as separate forwards) and streamed."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("llama4_text", hidden_size=64, intermediate_size=96, intermediate_size_mlp=96,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               vocab_size=128, num_local_experts=4, attention_chunk_size=4, floor_scale=2,
                               initializer_range=0.3, max_position_embeddings=64)
    assert set(cfg.layer_types) == {"chunked_attention", "full_attention"} and cfg.attn_temperature_tuning
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(tmp_path / "m")
    refs = [_reference(model, p, NEW) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) > 1
    for resident in (None, 0):
        eng = _engine(tmp_path / "m", tmp_path, cpu_mem="4GiB", max_batch=3, max_seq_len=40,
                      resident_layers=resident)
        try:
            assert eng.generic.offsets and eng.generic.chunk == 4
            assert _greedy(eng, PROMPTS, NEW) == refs, f"resident_layers={resident}"
        finally:
            eng.close()
