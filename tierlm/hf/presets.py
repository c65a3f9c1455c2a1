"""Architecture presets with the real shapes, and tiny variants of them for tests.

Shapes are copied from each source model's published config.json, so the planner can size a real
model (on `meta`, nothing allocated) and `init_model` can build a random one of the same shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .fields import get, put

if TYPE_CHECKING:  # annotations only: building the command line must not import them
    import torch
    import transformers

# Names, not classes: the command line builds its choices from them without importing transformers
# (seconds); ARCHS, the config classes, is made on first use (module __getattr__ below). These four
# have hand-written tiny shapes and closed-form parameter counts; every other decoder family
# transformers builds works too (`make_config` shrinks its default config, `param_count` counts it
# on `meta`), and FAMILIES lists those tested through every verb (tests/test_families.py).
ARCH_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "gpt2": "GPT2Config"}
ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel"}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo",
            "olmo2", "gpt_neox", "gpt2", "falcon", "starcoder2", "granite")


@dataclass(frozen=True)
class Preset:
    arch: str
    source: str  # where the numbers come from
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    tie_embeddings: bool
    dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)  # native config fields (rope, eps, token ids...)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA2 = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
_QWEN25 = {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "bos_token_id": 151643, "eos_token_id": 151643}

PRESETS: dict[str, Preset] = {
    "qwen2.5-0.5b": Preset("qwen2", "Qwen/Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, 32768, True,
                           extra=_QWEN25),
    "qwen2.5-1.5b": Preset("qwen2", "Qwen/Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936, 131072, True,
                           extra=_QWEN25),
    "qwen2.5-7b": Preset("qwen2", "Qwen/Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, 131072, False,
                         extra=_QWEN25),
    "tinyllama-1.1b": Preset("llama", "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", 22, 2048, 32, 4,
                             5632, 32000, 2048, False, extra=_LLAMA2),
    "llama-3.2-1b": Preset("llama", "meta-llama/Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, 131072, True,
                           extra={"rope_parameters": _LLAMA3_ROPE, "rms_norm_eps": 1e-5,
                                  "bos_token_id": 128000, "eos_token_id": 128001}),
    "llama-3.2-3b": Preset("llama", "meta-llama/Llama-3.2-3B", 28, 3072, 24, 8, 8192, 128256, 131072, True,
                           extra={"rope_parameters": _LLAMA3_ROPE, "rms_norm_eps": 1e-5,
                                  "bos_token_id": 128000, "eos_token_id": 128001}),
    "llama-2-7b": Preset("llama", "meta-llama/Llama-2-7b-hf", 32, 4096, 32, 32, 11008, 32000, 4096, False,
                         "float16", extra=_LLAMA2),
    "llama-2-13b": Preset("llama", "meta-llama/Llama-2-13b-hf", 40, 5120, 40, 40, 13824, 32000, 4096, False,
                          "float16", extra=_LLAMA2),
    "mistral-7b": Preset("mistral", "mistralai/Mistral-7B-v0.1", 32, 4096, 32, 8, 14336, 32000, 32768, False,
                         extra={**_LLAMA2, "sliding_window": 4096}),
    "gpt2": Preset("gpt2", "openai-community/gpt2", 12, 768, 12, 12, 3072, 50257, 1024, True, "float32",
                   extra={"bos_token_id": 50256, "eos_token_id": 50256}),
    # Never released; shapes from Brown et al. 2020, Table 2.1. For planning at 175B scale only.
    "gpt3-175b": Preset("gpt2", "GPT-3 175B (Brown et al. 2020, 'Language Models are Few-Shot Learners')",
                        96, 12288, 96, 96, 49152, 50257, 2048, True,
                        extra={"bos_token_id": 50256, "eos_token_id": 50256}),
}


@dataclass(frozen=True)
class NativePreset:
    """A published model's config.json fields as they are (any family): nothing derived."""
    arch: str
    source: str
    fields: dict

    def config(self):
        from transformers import CONFIG_MAPPING
        return CONFIG_MAPPING[self.arch](**self.fields)


_QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, head_dim=128,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, hidden_act="silu",
              bos_token_id=151643, eos_token_id=151645, attention_bias=False, dtype="bfloat16")
_GEMMA2 = dict(vocab_size=256000, max_position_embeddings=8192, head_dim=256, sliding_window=4096,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
               hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
               bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="bfloat16")
_GEMMA3 = dict(head_dim=256, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
               tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="bfloat16")

# Shapes from each model's published config.json (the fields that set its shape and arithmetic).
NATIVE_PRESETS: dict[str, NativePreset] = {
    "qwen3-0.6b": NativePreset("qwen3", "Qwen/Qwen3-0.6B", dict(
        _QWEN3, num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=3072, tie_word_embeddings=True)),
    "qwen3-1.7b": NativePreset("qwen3", "Qwen/Qwen3-1.7B", dict(
        _QWEN3, num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=6144, tie_word_embeddings=True)),
    "qwen3-4b": NativePreset("qwen3", "Qwen/Qwen3-4B", dict(
        _QWEN3, num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=9728, tie_word_embeddings=True)),
    "qwen3-8b": NativePreset("qwen3", "Qwen/Qwen3-8B", dict(
        _QWEN3, num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=12288, tie_word_embeddings=False)),
    "gemma-2-2b": NativePreset("gemma2", "google/gemma-2-2b", dict(
        _GEMMA2, num_hidden_layers=26, hidden_size=2304, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=9216)),
    "gemma-2-9b": NativePreset("gemma2", "google/gemma-2-9b", dict(
        _GEMMA2, num_hidden_layers=42, hidden_size=3584, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=14336)),
    "gemma-3-1b": NativePreset("gemma3_text", "google/gemma-3-1b-pt", dict(
        _GEMMA3, num_hidden_layers=26, hidden_size=1152, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # the text model of the multimodal google/gemma-3-4b-pt (its text_config)
    "gemma-3-4b": NativePreset("gemma3_text", "google/gemma-3-4b-pt text_config", dict(
        _GEMMA3, num_hidden_layers=34, hidden_size=2560, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=10240, vocab_size=262208, max_position_embeddings=131072, sliding_window=1024,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi-3-mini": NativePreset("phi3", "microsoft/Phi-3-mini-4k-instruct", dict(
        num_hidden_layers=32, hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=8192, vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=32000, pad_token_id=32000, dtype="bfloat16")),
    "phi-4": NativePreset("phi3", "microsoft/phi-4", dict(
        num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=10,
        intermediate_size=17920, vocab_size=100352, max_position_embeddings=16384, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 250000.0}, tie_word_embeddings=False,
        bos_token_id=100257, eos_token_id=100265, pad_token_id=100349, dtype="bfloat16")),
    "olmo-2-1b": NativePreset("olmo2", "allenai/OLMo-2-0425-1B", dict(
        num_hidden_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=8192, vocab_size=100352, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=100257, pad_token_id=100277, dtype="float32")),
    "smollm2-135m": NativePreset("llama", "HuggingFaceTB/SmolLM2-135M", dict(
        num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, dtype="bfloat16")),
}

# What `arch` alone means: a model small enough for unit tests, with GQA where the arch has it.
TINY: dict[str, Preset] = {
    "llama": Preset("llama", "tiny test model", 2, 64, 4, 2, 176, 512, 256, False, "float32",
                    extra={"rms_norm_eps": 1e-5}),
    "qwen2": Preset("qwen2", "tiny test model", 2, 64, 4, 2, 344, 512, 256, True, "float32",
                    extra={"rms_norm_eps": 1e-6}),
    "mistral": Preset("mistral", "tiny test model", 2, 64, 4, 2, 224, 512, 256, False, "float32",
                      extra={"rms_norm_eps": 1e-5, "sliding_window": 128}),
    "gpt2": Preset("gpt2", "tiny test model", 2, 64, 4, 4, 256, 512, 256, True, "float32"),
}

SHORT_KEYS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_positions", "dtype",
              "tie_embeddings", "rope_theta")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def _config_class(arch: str) -> type:
    import transformers
    return getattr(transformers, ARCH_CONFIGS[arch])


def __getattr__(name):
    if name == "ARCHS":
        return {a: _config_class(a) for a in ARCH_CONFIGS}
    raise AttributeError(name)


def dtype_name(dtype: str | torch.dtype) -> str:
    if not isinstance(dtype, str):  # a torch.dtype
        dtype = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(str(dtype).lower())
    if name is None:
        raise ValueError(f"dtype {dtype!r}: use one of bfloat16, float16, float32 (or bf16, fp16, fp32)")
    return name


def _pick_heads(hidden: int, want_head_dim: int) -> int:
    """Head count whose head_dim is even, divides hidden, and is closest to want_head_dim."""
    options = [h for h in range(1, hidden + 1) if hidden % h == 0 and (hidden // h) % 2 == 0]
    if not options:
        raise ValueError(f"hidden={hidden} must be even (RoPE needs an even head_dim)")
    return min(options, key=lambda h: (abs(math.log2(hidden / h / want_head_dim)), -h))


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, max(1, cap) + 1) if n % d == 0)


def _resolve(base: Preset, o: dict) -> dict:
    """Apply short overrides to a preset, deriving dependent shapes so they stay consistent."""
    hidden = int(o.get("hidden", base.hidden))
    if "heads" in o:
        heads = int(o["heads"])
    elif hidden != base.hidden:
        heads = _pick_heads(hidden, min(base.head_dim, max(2, hidden // 4)))
    else:
        heads = base.heads
    if heads <= 0 or hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"heads={heads} must divide hidden={hidden} into an even head_dim")
    if "kv_heads" in o:
        kv = int(o["kv_heads"])
        if kv <= 0 or heads % kv:
            raise ValueError(f"kv_heads={kv} must divide heads={heads}")
    elif heads != base.heads:
        kv = _largest_divisor_at_most(heads, heads // (base.heads // base.kv_heads))
    else:
        kv = base.kv_heads
    if base.arch == "gpt2" and kv != heads:
        raise ValueError("gpt2 has no grouped-query attention: kv_heads must equal heads")
    if "intermediate" in o:
        inter = int(o["intermediate"])
    elif hidden != base.hidden:  # keep the MLP ratio, rounded to a multiple of 8 for kernel friendliness
        inter = max(8, round(base.intermediate / base.hidden * hidden / 8) * 8)
    else:
        inter = base.intermediate
    return dict(hidden=hidden, heads=heads, kv=kv, inter=inter,
                layers=int(o.get("layers", base.layers)), vocab=int(o.get("vocab", base.vocab)),
                max_pos=int(o.get("max_positions", base.max_positions)),
                tie=bool(o.get("tie_embeddings", base.tie_embeddings)),
                dtype=dtype_name(o.get("dtype", base.dtype)))


def make_config(arch: str | None = None, preset: str | None = None,
                overrides: dict | None = None) -> transformers.PretrainedConfig:
    """Config for a preset or a tiny model of `arch` (any decoder family transformers builds), with
    overrides (short keys, or native config fields)."""
    if preset is not None and preset in NATIVE_PRESETS:
        base = NATIVE_PRESETS[preset]
        if arch is not None and arch != base.arch:
            raise ValueError(f"preset {preset!r} is a {base.arch} model, not {arch!r}; drop one of them")
        return _native(base.config(), overrides, f"preset {preset!r}")
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(preset_names())}")
        base = PRESETS[preset]
        if arch is not None and arch != base.arch:
            raise ValueError(f"preset {preset!r} is a {base.arch} model, not {arch!r}; drop one of them")
    elif arch is not None:
        if arch not in TINY:
            return _native(_tiny_family(arch), overrides, f"arch {arch!r}")
        base = TINY[arch]
    else:
        raise ValueError(f"give an arch ({', '.join(FAMILIES)}, or another decoder family transformers "
                         f"builds) or a preset ({', '.join(preset_names())})")
    cls = _config_class(base.arch)
    o = {str(k).replace("-", "_"): v for k, v in (overrides or {}).items()}
    native_fields = set(getattr(cls, "__dataclass_fields__", {})) | set(cls().to_dict())
    bad = [k for k in o if k not in SHORT_KEYS and k not in native_fields]
    if bad:
        raise ValueError(f"unknown override(s) {', '.join(bad)} for {base.arch}; use {', '.join(SHORT_KEYS)} "
                         f"or a {cls.__name__} field")
    r = _resolve(base, o)
    extra = dict(base.extra)
    for key in ("bos_token_id", "eos_token_id"):  # published ids are meaningless once vocab shrinks
        if extra.get(key) is not None and extra[key] >= r["vocab"]:
            extra[key] = None
    if base.arch == "gpt2":
        kw = dict(vocab_size=r["vocab"], n_positions=r["max_pos"], n_embd=r["hidden"], n_layer=r["layers"],
                  n_head=r["heads"], n_inner=None if r["inter"] == 4 * r["hidden"] else r["inter"],
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                  bos_token_id=extra.get("bos_token_id"), eos_token_id=extra.get("eos_token_id"))
    else:
        rope = dict(extra.pop("rope_parameters", None) or {"rope_type": "default",
                                                            "rope_theta": extra.pop("rope_theta", 10000.0)})
        extra.pop("rope_theta", None)
        if "rope_theta" in o:
            rope["rope_theta"] = float(o["rope_theta"])
        kw = dict(vocab_size=r["vocab"], hidden_size=r["hidden"], intermediate_size=r["inter"],
                  num_hidden_layers=r["layers"], num_attention_heads=r["heads"], num_key_value_heads=r["kv"],
                  max_position_embeddings=r["max_pos"], rope_parameters=rope, attention_dropout=0.0, **extra)
        if base.arch in ("llama", "mistral"):
            kw["head_dim"] = r["hidden"] // r["heads"]
        if base.arch == "qwen2":  # published Qwen2.5 configs: no sliding window in use, every layer full
            kw.update(use_sliding_window=False, max_window_layers=r["layers"])
    kw.update(tie_word_embeddings=r["tie"])
    kw.update({k: v for k, v in o.items() if k not in SHORT_KEYS})
    config = cls(**kw)
    config.dtype = r["dtype"]
    config.architectures = [ARCH_CLASSES[base.arch]]
    return config



def preset_names() -> list[str]:
    return sorted(PRESETS) + sorted(NATIVE_PRESETS)


def _tiny_family(arch: str):
    """A tiny fp32 model of any decoder family: its default config, shrunk (hf.fields.shrunk), no
    dropout (tests compare runs bit for bit)."""
    from transformers import CONFIG_MAPPING

    from .checks import family_problem
    if arch not in CONFIG_MAPPING:
        raise ValueError(f"unknown arch {arch!r}; tested families: {', '.join(FAMILIES)} (any decoder-only "
                         "causal LM family the installed transformers builds also works)")
    problem = family_problem({"model_type": arch})
    if problem:
        raise ValueError(f"arch {arch!r}: {problem}")
    from .fields import shrunk
    c = shrunk(CONFIG_MAPPING[arch](), layers=2, hidden=64, heads=4, kv_heads=2, intermediate=176, vocab=512)
    put(c, "max_positions", 256)
    for k, v in c.to_dict().items():
        if isinstance(v, float) and ("dropout" in k or k.endswith("pdrop")):
            setattr(c, k, 0.0)
    c.dtype = "float32"
    return c


def _native(config, overrides: dict | None, what: str):
    """Apply short overrides (layers, hidden, heads, ...) by role, keeping dependent shapes consistent,
    and native fields as given."""
    o = {str(k).replace("-", "_"): v for k, v in (overrides or {}).items()}
    native_fields = set(config.to_dict()) | set(getattr(type(config), "attribute_map", {}))
    bad = [k for k in o if k not in SHORT_KEYS and k not in native_fields]
    if bad:
        raise ValueError(f"unknown override(s) {', '.join(bad)} for {what}; use {', '.join(SHORT_KEYS)} "
                         f"or a {type(config).__name__} field")
    heads, hidden = get(config, "heads"), get(config, "hidden")
    view = Preset(config.model_type, what, get(config, "layers"), hidden, heads,
                  get(config, "kv_heads") or heads, get(config, "intermediate") or 4 * hidden,
                  get(config, "vocab"), get(config, "max_positions") or 0,
                  bool(getattr(config, "tie_word_embeddings", False)),
                  dtype_name(getattr(config, "dtype", None) or "float32"))
    if get(config, "kv_heads") is None and o.get("kv_heads") not in (None, heads, o.get("heads")):
        raise ValueError(f"{config.model_type} has no grouped-query attention: kv_heads must equal heads")
    r = _resolve(view, o)
    explicit_hd = get(config, "head_dim")
    for role, key in (("layers", "layers"), ("hidden", "hidden"), ("heads", "heads"), ("kv_heads", "kv"),
                      ("vocab", "vocab"), ("max_positions", "max_pos")):
        put(config, role, r[key])
    if get(config, "intermediate") is not None or "intermediate" in o:
        put(config, "intermediate", r["inter"])
    if explicit_hd is not None and (r["hidden"] != view.hidden or r["heads"] != view.heads):
        put(config, "head_dim", r["hidden"] // r["heads"])  # a family whose head_dim is its own field
    config.tie_word_embeddings = r["tie"]
    if "rope_theta" in o:
        rope = getattr(config, "rope_parameters", None)
        for part in (rope.values() if isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values())
                     else [rope] if isinstance(rope, dict) else []):
            part["rope_theta"] = float(o["rope_theta"])
    for k, v in o.items():
        if k not in SHORT_KEYS:
            setattr(config, k, v)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(config, key, None)
        if any(i is not None and i >= r["vocab"] for i in (v if isinstance(v, list) else [v])):
            setattr(config, key, None)  # published ids are meaningless once vocab shrinks
    config.dtype = r["dtype"]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    config.architectures = [CAUSAL[config.model_type]]
    return config


def param_count(config) -> int:
    """Unique parameters of the *ForCausalLM model (tied embeddings counted once), without building it."""
    mt = config.model_type
    if mt == "gpt2":
        h, v, n = config.n_embd, config.vocab_size, config.n_layer
        inner = config.n_inner or 4 * h
        if getattr(config, "add_cross_attention", False):
            raise ValueError("param_count: gpt2 with cross-attention is not supported")
        layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h)
        total = v * h + config.n_positions * h + n * layer + 2 * h
        return total + (0 if config.tie_word_embeddings else v * h)
    if mt not in ("llama", "qwen2", "mistral"):
        return _meta_count(config)
    h, v, n, i = config.hidden_size, config.vocab_size, config.num_hidden_layers, config.intermediate_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    attn = h * q + 2 * h * kv + q * h
    if mt == "qwen2":  # Qwen2 hard-codes biases on q, k, v (not o)
        attn += q + 2 * kv
    elif mt == "llama" and config.attention_bias:
        attn += q + 2 * kv + h
    mlp = 3 * h * i + ((2 * i + h) if mt == "llama" and config.mlp_bias else 0)
    total = v * h + n * (attn + mlp + 2 * h) + h
    return total + (0 if config.tie_word_embeddings else v * h)


def _meta_count(config) -> int:
    """Any family: the model built on `meta` (no memory; ~1 s for a 405B one), tied weights once."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in m.parameters())
