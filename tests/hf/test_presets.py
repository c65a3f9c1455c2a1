import pytest
import torch
from transformers import AutoModelForCausalLM

from tierlm.hf.fields import get
from tierlm.hf.presets import ARCHS, FAMILIES, NATIVE_PRESETS, PRESETS, make_config, param_count

# model.num_parameters() of the published checkpoints
PUBLISHED = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "tinyllama-1.1b": 1_100_048_384,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "mistral-7b": 7_241_732_096,
    "gpt2": 124_439_808,
}


def _meta_count(config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once


def test_required_presets_exist_with_sources():
    for name in ("qwen2.5-0.5b", "tinyllama-1.1b", "llama-3.2-1b", "llama-2-7b", "llama-2-13b", "mistral-7b",
                 "gpt2", "gpt3-175b"):
        assert name in PRESETS and PRESETS[name].source


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_count_is_exact(name):
    config = make_config(preset=name)
    assert param_count(config) == _meta_count(config)
    if name in PUBLISHED:
        assert param_count(config) == PUBLISHED[name]


def test_gpt3_shapes():
    c = make_config(preset="gpt3-175b")
    assert (c.model_type, c.n_layer, c.n_embd, c.n_head, c.n_positions, c.vocab_size) == \
        ("gpt2", 96, 12288, 96, 2048, 50257)
    assert 174e9 < param_count(c) < 176e9


def test_published_details():
    q = make_config(preset="qwen2.5-0.5b")
    assert (q.hidden_size, q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads) == (896, 24, 14, 2)
    assert q.tie_word_embeddings and q.rope_parameters["rope_theta"] == 1e6 and q.max_position_embeddings == 32768
    ll = make_config(preset="llama-3.2-1b")
    assert ll.rope_parameters["rope_type"] == "llama3" and ll.rope_parameters["factor"] == 32.0
    assert ll.rope_parameters["rope_theta"] == 500000.0 and ll.tie_word_embeddings and ll.head_dim == 64
    assert ll.dtype == "bfloat16" and ll.architectures == ["LlamaForCausalLM"]
    t = make_config(preset="tinyllama-1.1b")
    assert (t.num_key_value_heads, t.intermediate_size, t.max_position_embeddings) == (4, 5632, 2048)
    assert make_config(preset="mistral-7b").sliding_window == 4096


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("overrides", [
    {},
    {"hidden": 96},
    {"hidden": 128, "layers": 3, "kv_heads": 1, "vocab": 300},
    {"heads": 8, "intermediate": 100, "tie_embeddings": False},
    {"tie_embeddings": True, "max_positions": 64},
])
def test_tiny_param_count_matches_model(arch, overrides):
    if arch == "gpt2":
        overrides = {k: v for k, v in overrides.items() if k != "kv_heads"}
    c = make_config(arch, overrides=overrides)
    assert param_count(c) == _meta_count(c)
    heads = c.num_attention_heads if arch != "gpt2" else c.n_head
    hidden = c.hidden_size if arch != "gpt2" else c.n_embd
    assert hidden % heads == 0 and (hidden // heads) % 2 == 0
    if arch != "gpt2":
        assert heads % c.num_key_value_heads == 0
        assert c.head_dim == hidden // heads if hasattr(c, "head_dim") else True


@pytest.mark.parametrize("extra", [{"attention_bias": True}, {"mlp_bias": True}])
def test_llama_bias_variants_counted(extra):
    c = make_config("llama", overrides=extra)
    assert param_count(c) == _meta_count(c)


def test_derived_shapes_when_only_hidden_changes():
    c = make_config(preset="tinyllama-1.1b", overrides={"hidden": 1024})
    assert c.num_attention_heads == 16 and c.head_dim == 64  # head_dim kept
    assert c.num_key_value_heads == 2  # group size 8 kept
    assert c.intermediate_size == 2816  # MLP ratio kept
    c = make_config("llama", overrides={"hidden": 48})
    assert 48 % c.num_attention_heads == 0 and (48 // c.num_attention_heads) % 2 == 0
    assert c.num_attention_heads % c.num_key_value_heads == 0
    g = make_config("gpt2", overrides={"hidden": 96})
    assert g.n_embd == 96 and 96 % g.n_head == 0 and g.n_inner is None  # 4 * hidden


def test_tiny_defaults_and_dropout():
    c = make_config("llama")
    assert (c.num_hidden_layers, c.hidden_size) == (2, 64)
    g = make_config("gpt2")
    assert g.resid_pdrop == g.embd_pdrop == g.attn_pdrop == 0.0
    assert make_config(preset="gpt2").attn_pdrop == 0.0
    assert make_config("qwen2").attention_dropout == 0.0
    assert make_config("llama", overrides={"dtype": "bf16"}).dtype == "bfloat16"
    assert make_config("llama", overrides={"dtype": torch.float16}).dtype == "float16"
    assert make_config("llama", overrides={"rms_norm_eps": 1e-3}).rms_norm_eps == 1e-3  # native field
    assert make_config("qwen2", overrides={"rope_theta": 1234.0}).rope_parameters["rope_theta"] == 1234.0
    # published token ids that fall outside a shrunken vocab are dropped
    small = make_config(preset="llama-3.2-1b", overrides={"vocab": 512, "layers": 1, "hidden": 64})
    assert small.bos_token_id is None and small.eos_token_id is None


def test_errors_list_valid_names():
    with pytest.raises(ValueError, match="tested families: llama, mistral, qwen2, qwen3"):
        make_config("no-such-family")
    with pytest.raises(ValueError, match="encoder"):
        make_config("bert")
    with pytest.raises(ValueError, match="multimodal.*gemma3_text"):
        make_config("gemma3")
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        make_config(preset="llama-9b")
    with pytest.raises(ValueError, match="give an arch"):
        make_config()
    with pytest.raises(ValueError, match="is a llama model"):
        make_config("gpt2", preset="llama-2-7b")
    with pytest.raises(ValueError, match="unknown override.*hiden"):
        make_config("llama", overrides={"hiden": 64})
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        make_config("llama", overrides={"kv_heads": 3})
    with pytest.raises(ValueError, match="heads=5"):
        make_config("llama", overrides={"heads": 5})
    with pytest.raises(ValueError, match="gpt2 has no grouped-query"):
        make_config("gpt2", overrides={"kv_heads": 1})
    with pytest.raises(ValueError, match="dtype"):
        make_config("llama", overrides={"dtype": "int3"})


# Published sizes from the model cards (billions, as rounded there), the counts the shapes must give.
CARDS = {"qwen3-0.6b": 0.596, "qwen3-1.7b": 1.72, "qwen3-4b": 4.02, "qwen3-8b": 8.19, "gemma-2-2b": 2.61,
         "gemma-2-9b": 9.24, "gemma-3-1b": 1.0, "phi-3-mini": 3.82, "phi-4": 14.66, "olmo-2-1b": 1.48,
         "smollm2-135m": 0.1345}


@pytest.mark.parametrize("name", sorted(NATIVE_PRESETS))
def test_native_presets_build_with_published_sizes(name):
    c = make_config(preset=name)
    n = param_count(c)
    assert n == _meta_count(c)
    if name in CARDS:
        assert abs(n / 1e9 - CARDS[name]) / CARDS[name] < 0.03, n
    small = make_config(preset=name, overrides={"layers": 1, "hidden": 64, "vocab": 256})
    assert (get(small, "layers"), get(small, "hidden"), get(small, "vocab")) == (1, 64, 256)
    assert small.model_type == c.model_type and param_count(small) == _meta_count(small)


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_has_a_tiny_model_and_takes_overrides(arch):
    from transformers import CONFIG_MAPPING
    c = make_config(arch)
    assert c.model_type == arch and get(c, "hidden") == 64 and 2 <= get(c, "layers") <= 8
    types = getattr(CONFIG_MAPPING[arch](), "layer_types", None)
    if get(c, "layers") > 2 or isinstance(types, list) and max(types.index(t) for t in set(types)) < 8:
        # a layer of every type the family's pattern has (Qwen3.5's attention after three linear ones)
        assert set(c.layer_types) == set(types)
    assert param_count(c) == _meta_count(c)
    big = make_config(arch, overrides={"layers": 3, "hidden": 128, "heads": 8})
    assert (get(big, "layers"), get(big, "hidden"), get(big, "heads")) == (3, 128, 8)
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(big)  # consistent shapes: the model builds
    assert not any(v for k, v in big.to_dict().items() if isinstance(v, float) and "dropout" in k)


# Mixtures of experts: published (total, active a token) parameters, billions; DeepSeek-V3's without its
# multi-token-prediction layer (transformers does not build it).
MOE_CARDS = {"mixtral-8x7b": (46.7, 12.9), "qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235.0, 22.0),
             "deepseek-v3": (671.0, 37.0)}


@pytest.mark.parametrize("name", sorted(MOE_CARDS))
def test_moe_presets_have_published_total_and_active_sizes(name):
    """Counted on the model transformers builds (meta): all parameters, and those a token goes
    through (each stacked expert parameter scaled by top_k / experts); the planner's shape agrees."""
    from tierlm.plan.shapes import shape_of
    c = make_config(preset=name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(c)
    k = c.num_experts_per_tok
    total = sum(p.numel() for p in model.parameters())
    active = sum(p.numel() * k // p.shape[0] if ".experts." in n else p.numel() for n, p in model.named_parameters())
    want_total, want_active = MOE_CARDS[name]
    assert abs(total / 1e9 - want_total) / want_total < 0.03, total
    assert abs(active / 1e9 - want_active) / want_active < 0.03, active
    s = shape_of(c, name, "test")
    assert (s.params, s.active_params) == (total, active)


def test_deepseek_v3_preset_has_its_latent_attention_and_dense_first_layers():
    c = make_config(preset="deepseek-v3")
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim) == \
        (1536, 512, 64, 128, 128)
    assert (c.n_group, c.topk_group, c.first_k_dense_replace, c.n_shared_experts, c.n_routed_experts) == \
        (8, 4, 3, 1, 256)
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size, c.moe_intermediate_size, c.intermediate_size) == \
        (61, 7168, 129280, 2048, 18432)
    m = make_config(preset="mixtral-8x7b")
    assert (m.num_local_experts, m.num_experts_per_tok, m.num_key_value_heads) == (8, 2, 8)


def test_a_head_dim_the_family_leaves_none_is_filled():
    """Hunyuan's config defaults head_dim to None and its attention computes head_dim ** -0.5:
    `tierlm init --arch hunyuan_v1_dense` failed inside transformers."""
    from transformers import AutoModelForCausalLM
    for arch in ("hunyuan_v1_dense", "hunyuan_v1_moe"):
        c = make_config(arch, None, {"layers": 2, "hidden": 128, "heads": 4})
        assert c.head_dim == 32
        AutoModelForCausalLM.from_config(c)


def test_a_tiny_model_of_a_family_without_attention():
    """`tierlm init --arch mamba`: the shape's keys without heads (it has none to set)."""
    cfg = make_config("mamba", None, {"layers": 3, "hidden": 96})
    assert cfg.num_hidden_layers == 3 and cfg.hidden_size == 96
    with pytest.raises(ValueError, match="mamba has no attention heads"):
        make_config("mamba", None, {"heads": 2})


def test_layers_with_values_of_their_own_keep_them_in_tiny_copies():
    """Gemma 4's config gives its global layers their own head dim (and KV heads) through
    transformers' per-layer config, where reading `config.head_dim` raises: `tierlm init --arch
    gemma4_text` failed with that traceback. The tiny model keeps the global layer twice as wide as
    the sliding ones, `--layers` and `--hidden` carry that along the family's pattern, and its side
    tables (the per-layer embeddings' vocabulary and width) shrink with the rest."""
    from transformers import AutoModelForCausalLM
    from tierlm.hf.fields import head_dim, layer_get, overrides
    from tierlm.hf.kv_layout import kv_token_bytes
    c = make_config("gemma4_text", None, {})
    assert c.num_hidden_layers == 6 and c.layer_types[5] == "full_attention"
    assert overrides(c) == {5: {"head_dim": 32}} and head_dim(c) == 32
    assert c.vocab_size_per_layer_input == 512 and c.hidden_size_per_layer_input == 16
    c = make_config("gemma4_text", None, {"layers": 12, "hidden": 128, "heads": 4, "kv_heads": 2})
    assert [layer_get(c, "head_dim", i) for i in range(12)] == [32] * 5 + [64] + [32] * 5 + [64]
    assert kv_token_bytes(c) == 12 * 2 * 2 * 32 + 2 * 2 * 2 * 32  # the two global layers twice as wide
    m = AutoModelForCausalLM.from_config(c)
    assert m.model.layers[11].self_attn.q_proj.out_features == 4 * 64
    assert m.model.layers[10].self_attn.q_proj.out_features == 4 * 32


def test_what_a_config_derives_from_its_sizes_follows_a_small_copys_sizes():
    """Zamba2's config sets its Mamba head width, attention width and hybrid layers' ids in
    __post_init__ from hidden_size and the layer pattern, and a config read back from its JSON
    keeps them as written: `tierlm init --arch zamba2` wrote a 64-wide model with the published
    640-wide Mamba heads, and fine-tuning it failed in its first forward. A small copy's derived
    values are made again by the family's own class; what the copy sets itself, and a value a
    layer (SmolLM3's rotary-free fourth layer), stay."""
    from transformers import AutoConfig, MambaConfig, Zamba2Config

    from tierlm.hf.fields import shrunk
    c = make_config("zamba2", None, {})
    assert c.hidden_size == 64 and c.mamba_headdim == int(c.mamba_expand * 64) // c.n_mamba_heads
    assert c.attention_hidden_size == 128
    assert c.hybrid_layer_ids == [i for i, t in enumerate(c.layers_block_type) if t == "hybrid"] != []
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(c).eval()(input_ids=torch.zeros((1, 4), dtype=torch.long))
    s = shrunk(Zamba2Config(), layers=2)
    assert s.mamba_headdim == int(s.mamba_expand * 64) // s.n_mamba_heads and s.kv_channels == 16
    s = shrunk(MambaConfig(), layers=2)  # a field left None by the default, derived from hidden_size
    assert s.hidden_size == 64 and s.time_step_rank == 4
    cfg = AutoConfig.for_model("smollm3", hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=32)
    s = shrunk(cfg, layers=2, every_kind=True)
    assert s.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0] and s.head_dim == 16


@pytest.mark.parametrize("arch", ["bamba", "granitemoehybrid", "dory", "gemma3n_text"])
def test_small_shapes_the_familys_own_checks_would_reject_are_made_anew(arch):
    """Shrinking sets fields past the checks the family's config class runs when made: a field the
    default derived from the old sizes (Bamba's and Granite 4's Mamba head width, Dory's layer
    counts, Gemma 3n's per-layer sparsity) disagreed with the new ones, and `tierlm init --arch`
    died in a traceback. The config is made anew from what shrinking changed."""
    from transformers import AutoModelForCausalLM
    c = make_config(arch, None, {})
    type(c).from_dict(c.to_dict())                       # the family's own checks pass
    assert c.hidden_size == 64
    AutoModelForCausalLM.from_config(c)


def test_a_small_shape_the_family_still_rejects_is_refused_with_its_reason(monkeypatch):
    """dots3-note's check wants its sliding layers' head equal to their latent parts, which shrinking
    alone leaves at the published sizes: without its table entry, refused with that reason."""
    from tierlm.hf.preset_tables import TINY_FIELDS
    monkeypatch.delitem(TINY_FIELDS, "dots3_note_text")
    with pytest.raises(ValueError, match="dots3_note_text.*SWA head_dim must equal.*save_pretrained"):
        make_config("dots3_note_text", None, {})


# the families whose tiny model transformers itself cannot make or build (its defaults leave
# fields unset that no table here fills, or its own check rejects them): refused with the reason
_UNBUILT: set[str] = set()  # none with transformers 5.25


def test_every_causal_family_makes_a_tiny_model_or_is_refused_by_name():
    """`tierlm init --arch X` for every family transformers has a causal LM class for: a config
    transformers builds (on meta), or a refusal that names the family and why; never a traceback.
    Every tested family builds, and those whose transformers defaults leave what their modules
    need unset (DBRX's rotary base, dots.llm1's expert counts, LFM2-MoE's layer types) or rejected
    at a small shape (Kolibri 1.1's indexer heads) or leave unset (Qwen4-Exp's indexer) get it
    from the tiny table; Nemotron-H's layer count (a property) and TrOCR's (an attribute_map entry)
    are read and set by role."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from tierlm.hf.checks import TESTED
    from tierlm.hf.init import file_layout
    unbuilt, refused = set(), set()
    for arch in sorted(CAUSAL):
        try:
            c = make_config(arch)
        except ValueError as e:
            why = str(e)
            assert why.startswith(f"arch {arch!r}: "), why
            if "cannot make" in why or "cannot be built" in why or "rejects tierlm's small shape" in why:
                unbuilt.add(arch)
            else:
                assert any(k in why for k in ("encoder-decoder", "encoder (bidirectional)", "multimodal wrapper",
                                              "built of several models", "assistant (draft) model")), why
                refused.add(arch)
            continue
        assert c.model_type == arch or (arch, c.model_type) == ("gpt-sw3", "gpt2")  # GPT-SW3's config is GPT-2's
        # and the files init writes, as the family's save would name and shape them (Inkling 2's
        # conversion pads its head from an unpadded vocabulary shrinking has to shrink too)
        with torch.device("meta"):
            assert file_layout(AutoModelForCausalLM.from_config(c))
    assert unbuilt <= _UNBUILT, unbuilt - _UNBUILT
    assert not (unbuilt | refused) & set(TESTED)
    assert {"dbrx", "dots1", "lfm2_moe", "mamba2", "gpt_neo", "kolibri1_1", "nemotron_h", "trocr"}.isdisjoint(
        unbuilt | refused)
    assert {"blt", "musicgen", "whisper"} <= refused   # nested models; a decoder of an encoder-decoder
    assert {"gemma4_assistant", "gemma4_unified_assistant"} <= refused  # drafts that run on a target's states
