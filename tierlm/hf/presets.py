"""Building a model config from an architecture preset (hf/preset_tables.py) or any decoder family
transformers builds, with short overrides (layers, hidden, heads, ...) that keep dependent shapes
consistent; and counting a config's parameters without building the model.

Shapes are copied from each source model's published config.json, so the planner can size a real
model (on `meta`, nothing allocated) and `init_model` can build a random one of the same shape.
"""
from __future__ import annotations

import copy
import dataclasses

import math
from typing import TYPE_CHECKING

from .fields import _read, get, intermediate, put, rescale_overrides
from .preset_tables import (ARCH_CLASSES, ARCH_CONFIGS, FAMILIES, NATIVE_PRESETS, PRESETS, TINY, TINY_FIELDS,
                            NativePreset, Preset, Shape)

if TYPE_CHECKING:  # annotations only: building the command line must not import them
    import torch
    import transformers

__all__ = ["ARCH_CLASSES", "ARCH_CONFIGS", "FAMILIES", "NATIVE_PRESETS", "PRESETS", "SHORT_KEYS", "TINY",
           "NativePreset", "Preset", "Shape", "dtype_name", "make_config", "param_count", "preset_names"]

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
    s = base.shape
    hidden = int(o.get("hidden", s.hidden))
    if "heads" in o:
        heads = int(o["heads"])
    elif hidden != s.hidden:
        heads = _pick_heads(hidden, min(s.head_dim, max(2, hidden // 4)))
    else:
        heads = s.heads
    if heads <= 0 or hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"heads={heads} must divide hidden={hidden} into an even head_dim")
    if "kv_heads" in o:
        kv = int(o["kv_heads"])
        if kv <= 0 or heads % kv:
            raise ValueError(f"kv_heads={kv} must divide heads={heads}")
    elif heads != s.heads:
        kv = _largest_divisor_at_most(heads, heads // (s.heads // s.kv_heads))
    else:
        kv = s.kv_heads
    if base.arch == "gpt2" and kv != heads:
        raise ValueError("gpt2 has no grouped-query attention: kv_heads must equal heads")
    if "intermediate" in o:
        inter = int(o["intermediate"])
    elif hidden != s.hidden:  # keep the MLP ratio, rounded to a multiple of 8 for kernel friendliness
        inter = max(8, round(s.intermediate / s.hidden * hidden / 8) * 8)
    else:
        inter = s.intermediate
    return dict(hidden=hidden, heads=heads, kv=kv, inter=inter,
                layers=int(o.get("layers", s.layers)), vocab=int(o.get("vocab", s.vocab)),
                max_pos=int(o.get("max_positions", s.max_positions)),
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
    if preset is None and arch is not None and arch not in TINY:
        return _builds(arch, _native(_tiny_family(arch), overrides, f"arch {arch!r}"))
    base = _table_preset(arch, preset)
    cls = _config_class(base.arch)
    o = {str(k).replace("-", "_"): v for k, v in (overrides or {}).items()}
    native_fields = set(getattr(cls, "__dataclass_fields__", {})) | set(cls().to_dict())
    bad = [k for k in o if k not in SHORT_KEYS and k not in native_fields]
    if bad:
        raise ValueError(f"unknown override(s) {', '.join(bad)} for {base.arch}; use {', '.join(SHORT_KEYS)} "
                         f"or a {cls.__name__} field")
    r = _resolve(base, o)
    kw = _config_fields(base, r, o)
    kw.update(tie_word_embeddings=r["tie"])
    kw.update({k: v for k, v in o.items() if k not in SHORT_KEYS})
    config = cls(**kw)
    config.dtype = r["dtype"]
    config.architectures = [ARCH_CLASSES[base.arch]]
    return config


def _table_preset(arch: str | None, preset: str | None) -> Preset:
    """The table preset named (PRESETS), or `arch`'s tiny one (TINY)."""
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(preset_names())}")
        base = PRESETS[preset]
        if arch is not None and arch != base.arch:
            raise ValueError(f"preset {preset!r} is a {base.arch} model, not {arch!r}; drop one of them")
        return base
    if arch is not None:
        return TINY[arch]
    raise ValueError(f"give an arch ({', '.join(FAMILIES)}, or another decoder family transformers "
                     f"builds) or a preset ({', '.join(preset_names())})")


def _config_fields(base: Preset, r: dict, o: dict) -> dict:
    """The config class's fields for the resolved shape `r` of a table preset, in its family's names."""
    extra = dict(base.extra)
    for key in ("bos_token_id", "eos_token_id"):  # published ids are meaningless once vocab shrinks
        if extra.get(key) is not None and extra[key] >= r["vocab"]:
            extra[key] = None
    if base.arch == "gpt2":
        return dict(vocab_size=r["vocab"], n_positions=r["max_pos"], n_embd=r["hidden"], n_layer=r["layers"],
                    n_head=r["heads"], n_inner=None if r["inter"] == 4 * r["hidden"] else r["inter"],
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                    bos_token_id=extra.get("bos_token_id"), eos_token_id=extra.get("eos_token_id"))
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
    return kw


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
    try:
        default = CONFIG_MAPPING[arch]()
    except Exception as e:  # noqa: BLE001 -- transformers' own check of its own defaults
        raise ValueError(f"arch {arch!r}: transformers cannot make the {arch} config from its own defaults "
                         f"({_last_line(e)}); make the model with transformers and give tierlm its "
                         "directory") from e
    problem = family_problem(default.to_dict())  # what its defaults say: encoder-decoder, nested models
    if problem:
        raise ValueError(f"arch {arch!r}: {problem}")
    # layers of every type the family's pattern has (Qwen3.5's fourth layer is its first attention
    # one; Gemma 3's sixth its first global one), so `--layers N` repeats the family's own pattern
    types = getattr(default, "layer_types", None)
    need = max(types.index(t) for t in set(types)) + 1 if isinstance(types, list) and types else 2
    c = shrunk(default, layers=need if 2 < need <= 8 else 2, hidden=64, heads=4, kv_heads=2, intermediate=176,
               vocab=512)
    if 2 < need <= 8 and getattr(c, "layer_types", None) != list(types[:need]):
        try:
            c.layer_types = list(types[:need])
        except AttributeError:  # derived from other fields (Jamba's attention period and offset)
            pass
    put(c, "max_positions", 256)
    for k, v in c.to_dict().items():
        if isinstance(v, float) and ("dropout" in k or k.endswith("pdrop")):
            setattr(c, k, 0.0)
    for k, v in TINY_FIELDS.get(arch, {}).items():
        sub = _read(c, k)  # (a field some layers override raises when read plainly)
        if isinstance(v, dict) and hasattr(sub, "to_dict"):  # a sub-config (DBRX's attn_config): its fields
            for kk, vv in v.items():
                setattr(sub, kk, vv)
        else:
            setattr(c, k, v)
    c.dtype = "float32"
    return _family_checked(arch, default, c)


def _last_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__


def _builds(arch: str, c):
    """`c`, once transformers has built its model from it (on `meta`: nothing allocated); a family
    whose defaults leave unset what its modules need (or overrides that disagree with them) is
    refused with the modules' complaint."""
    import torch
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(copy.deepcopy(c))
    except Exception as e:  # noqa: BLE001 -- the family's own modules; the reason goes into the refusal
        raise ValueError(f"arch {arch!r}: transformers' {arch} modules cannot be built from its default config "
                         f"made small and the overrides given ({type(e).__name__}: {_last_line(e)}); make the model "
                         f"with transformers "
                         f"(AutoConfig.for_model({arch!r}, ...), save_pretrained) and give tierlm its "
                         "directory") from e
    return c


def _family_checked(arch: str, default, c):
    """`c` as the family's own config class accepts it. Shrinking sets fields one by one, past the
    checks the class runs when it is made; a field the default derived from the old sizes (Bamba's
    and Granite 4's Mamba head width, Dory's layer counts, Gemma 3n's per-layer sparsity) then
    disagrees with the new ones. Such a config is made anew from what shrinking changed, so the
    class derives the rest from the new sizes; one it still rejects is refused with its reason."""
    try:
        type(c).from_dict(c.to_dict())
        return c
    except Exception:  # noqa: BLE001 -- the class's own check; retried below
        pass
    before, after = default.to_dict(), c.to_dict()
    changed = {k: v for k, v in after.items() if k != "transformers_version" and before.get(k, object()) != v}
    try:
        made = type(default)(**changed)
        type(made).from_dict(made.to_dict())
        return made
    except Exception as e:  # noqa: BLE001 -- the reason goes into the refusal
        why = _last_line(e)
        raise ValueError(f"arch {arch!r}: transformers' check of the {arch} config rejects tierlm's small shape "
                         f"({why}); make the model with transformers (AutoConfig.for_model({arch!r}, ...), "
                         "save_pretrained) and give tierlm its directory") from e


def _native(config, overrides: dict | None, what: str):
    """Apply short overrides (layers, hidden, heads, ...) by role, keeping dependent shapes consistent,
    and native fields as given."""
    o = {str(k).replace("-", "_"): v for k, v in (overrides or {}).items()}
    before = copy.deepcopy(config)
    native_fields = set(config.to_dict()) | set(getattr(type(config), "attribute_map", {}))
    bad = [k for k in o if k not in SHORT_KEYS and k not in native_fields]
    if bad:
        raise ValueError(f"unknown override(s) {', '.join(bad)} for {what}; use {', '.join(SHORT_KEYS)} "
                         f"or a {type(config).__name__} field")
    heads, hidden = get(config, "heads"), get(config, "hidden")
    view = Preset(config.model_type, what,
                  Shape(get(config, "layers"), hidden, heads, get(config, "kv_heads") or heads,
                        intermediate(config, 4 * hidden), get(config, "vocab"),
                        get(config, "max_positions") or 0),
                  bool(getattr(config, "tie_word_embeddings", False)),
                  dtype_name(getattr(config, "dtype", None) or "float32"))
    if get(config, "kv_heads") is None and o.get("kv_heads") not in (None, heads, o.get("heads")):
        raise ValueError(f"{config.model_type} has no grouped-query attention: kv_heads must equal heads")
    if heads is None:  # no attention at all (Mamba): the shapes without heads
        if "heads" in o or "kv_heads" in o:
            raise ValueError(f"{config.model_type} has no attention heads; drop heads / kv_heads")
        view = dataclasses.replace(view, shape=dataclasses.replace(view.shape, heads=1, kv_heads=1))
    r = _resolve(view, dict(o, heads=1) if heads is None else o)
    explicit_hd = get(config, "head_dim")
    for role, key in (("layers", "layers"), ("hidden", "hidden"), ("heads", "heads"), ("kv_heads", "kv"),
                      ("vocab", "vocab"), ("max_positions", "max_pos")):
        if heads is None and role in ("heads", "kv_heads"):
            continue
        put(config, role, r[key])
    if get(config, "intermediate") is not None or "intermediate" in o:
        inter = r["inter"]
        if isinstance(get(config, "intermediate"), (list, tuple)):  # a width a layer (Gemma 3n's): each the same
            inter = [inter] * r["layers"]
        put(config, "intermediate", inter)
    if explicit_hd is not None and (r["hidden"] != view.shape.hidden or r["heads"] != view.shape.heads):
        put(config, "head_dim", r["hidden"] // r["heads"])  # a family whose head_dim is its own field
    elif "head_dim" in config.to_dict() and get(config, "head_dim") is None:
        # a field left None by the family's defaults that its modules read as a number (Hunyuan's)
        config.head_dim = r["hidden"] // r["heads"]
    rescale_overrides(before, config)
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
