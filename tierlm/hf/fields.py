"""A model config's shape by role, whatever the family calls its fields.

Families name the same thing differently (GPT-2's `n_embd`, Falcon's `num_kv_heads` and
`ffn_hidden_size`, MPT's `d_model`); transformers' `attribute_map` covers some of it. These helpers
read and set a shape by role on any config, so presets, overrides and the tiny copies the budget
measures need no per-family code.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings

ROLES = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim"),
    "vocab": ("vocab_size",),
    "max_positions": ("max_position_embeddings", "n_positions", "max_seq_len"),
    "head_dim": ("head_dim",),
    # mixtures of experts
    "expert_intermediate": ("moe_intermediate_size",),
    "shared_intermediate": ("shared_expert_intermediate_size",),
    "experts_per_token": ("num_experts_per_tok", "moe_topk", "top_k", "top_k_experts"),
    "dense_first": ("first_k_dense_replace",),      # leading layers with a dense MLP
    "rope_head_dim": ("qk_rope_head_dim",),          # latent attention: the rotary part of each head
    "latent_kv": ("kv_lora_rank",),                  # latent attention: the compressed KV's width
    "index_key": ("index_head_dim",),                # sparse attention's indexer: its one key a token
}


def _field(config, role: str) -> str | None:
    # a transformers config, a planning shape's namespace (plan.cost.hf_like_config) or a dict
    own = config.to_dict() if hasattr(config, "to_dict") else vars(config) if hasattr(config, "__dict__") \
        else dict(config)
    f = next((f for f in ROLES[role] if f in own), None)
    if f is None and hasattr(config, "to_dict"):
        # a transformers config may give a role only as an attribute it can also set: through its
        # attribute_map (TrOCR's num_hidden_layers is its decoder_layers) or a property with a setter
        # (Nemotron-H's layer count, from its pattern of layer types); not a value derived only
        # (Falcon's head_dim)
        cls = type(config)
        f = next((f for f in ROLES[role] if (f in getattr(cls, "attribute_map", {}) or
                                             getattr(getattr(cls, f, None), "fset", None) is not None)
                  and _readable(config, f)), None)
    return f


def _readable(config, f: str) -> bool:
    """Whether the config gives a value for `f` (XLNet's max_position_embeddings raises: it has
    no such limit)."""
    try:
        return _read(config, f) is not None
    except Exception:  # noqa: BLE001 -- a property that refuses to answer gives no value
        return False


def _read(config, f: str):
    """A config field; on a config with per-layer values (transformers' heterogeneous configs: Gemma
    4's wider global layers), the global value, which the layers without an override have."""
    plain = getattr(config, "_getattr_without_heterogeneous_validation", None)
    return plain(f, None) if plain is not None else getattr(config, f, None)


def get(config, role: str, default=None):
    f = _field(config, role)
    v = _read(config, f) if f else None
    return default if v is None else v


def intermediate(config, default=None):
    """The MLP's width: the widest layer's where the config gives one a layer (Gemma 3n's list)."""
    v = get(config, "intermediate") or getattr(config, "n_inner", None)
    if isinstance(v, (list, tuple)):
        v = max(v) if v else None
    return default if v is None else v


def overrides(config) -> dict[int, dict]:
    """Per-layer values that differ from the global ones ({layer: {field: value}}); {} for the usual
    config whose layers all share its fields."""
    if not getattr(config, "is_heterogeneous", False):
        return {}
    return {int(i): dict(v) for i, v in config._heterogeneity_spec.per_layer_overrides.items()}


def widest(config, role: str, default=None):
    """The largest value of `role` over the global one and every layer's own (dots3-note's sliding
    layers keep half the heads of its others; reading such a field globally raises): what an
    estimate that must hold for every layer takes."""
    vals = [get(config, role)] + [v.get(f) for v in overrides(config).values() for f in ROLES[role] if f in v]
    vals = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return max(vals) if vals else default


def layer_config(config, i: int):
    """Layer i's config: the config itself, or where layers differ, its view with the layer's own values."""
    return config.per_layer_config[i] if overrides(config) else config


def layer_get(config, role: str, i: int, default=None):
    return get(layer_config(config, i), role, default)


def _set_overrides(config, table: dict[int, dict]) -> None:
    config.per_layer_config = {i: v for i, v in table.items() if v} or None


def put(config, role: str, value) -> bool:
    """Set `role` where the config has a field for it; False where it has none (GPT-NeoX has no
    separate KV heads). Layers also trims or extends `layer_types` and the layers' own values (the
    pattern repeats)."""
    f = _field(config, role)
    if f is None:
        return False
    before = getattr(config, f, None) if role == "layers" else None  # (a per-layer field raises when read)
    try:
        setattr(config, f, value)
    except NotImplementedError:  # a property the family will not set (XLNet's positions: it has no limit)
        return False
    if role == "layers":
        types = getattr(config, "layer_types", None)
        # transformers checks its length; lists indexed by layer (no_rope_layers) may be longer
        # and the other per-layer type lists it checks the same way (Kimi's mlp_layer_types)
        lists = {k: v for k, v in vars(config).items() if k.endswith("layer_types") and isinstance(v, (list, tuple))}
        # numbers given a layer, as many as the layers were (Gemma 3n's activation_sparsity_pattern),
        # where there are now more layers: the pattern repeats too (a longer list is left as it is:
        # the modules index it by layer, as SmolLM3's no_rope_layers)
        if isinstance(before, int) and 1 < before < value:
            lists.update({k: v for k, v in vars(config).items() if not k.startswith("_") and "token" not in k
                          and isinstance(v, (list, tuple)) and len(v) == before
                          and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)})
        if types:
            lists["layer_types"] = types
        for k, v in lists.items():
            if not v:
                continue
            try:
                setattr(config, k, [v[i % len(v)] for i in range(value)])
            except AttributeError:  # derived from the layer count (Jamba's, Bamba's: a property without setter)
                pass
        table, old = overrides(config), len(types) if types else None
        if table and old:  # per-layer values follow the layer pattern as layer_types does
            _set_overrides(config, {i: table[i % old] for i in range(value) if i % old in table})
    return True


def per_layer_lists(config) -> dict[str, list]:
    """The config's lists of (at least) one entry per decoder layer, cut to the layers (layer_types,
    SmolLM3's no_rope_layers: its modules index it by layer, and a preset cut from 36 layers keeps
    all 36). A list of something else as long is taken too: it can only add layers to a copy."""
    n = get(config, "layers")
    if not isinstance(n, int) or n < 2:
        return {}
    return {k: list(v)[:n] for k, v in vars(config).items()
            if not k.startswith("_") and isinstance(v, (list, tuple)) and len(v) >= n}


def head_dim(config) -> int:
    """The widest head of any layer (what sizes attention's scratch)."""
    dims = [get(layer_config(config, i), "head_dim") for i in sorted(overrides(config))]
    return max([get(config, "head_dim") or get(config, "hidden") // get(config, "heads")]
               + [d for d in dims if d])


def shrunk(config, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
           intermediate: int = 96, vocab: int = 128, every_kind: bool = False):
    """A small copy of `config`: the same family and options (rotary variant, norms, soft-capping,
    sliding pattern, biases), tiny shapes. Layers keep the first `layers` of the layer pattern;
    with every_kind, more where it takes more to hold every kind of layer the per-layer lists make
    (SmolLM3's rotary-free fourth layer; a full-attention layer after three sliding ones): what a
    check of the family's maths must see."""
    c = copy.deepcopy(config)
    per = per_layer_lists(config) if every_kind else {}
    if per:
        kinds = list(zip(*per.values()))
        layers = max(layers, max(kinds.index(k) for k in set(kinds)) + 1)
    put(c, "layers", min(layers, get(config, "layers", layers)))
    put(c, "hidden", hidden)
    put(c, "heads", heads)
    # multi-head attention stays so (DeepSeek's latent attention expands its keys to every head)
    mha = get(config, "kv_heads") in (None, get(config, "heads"))
    put(c, "kv_heads", heads if mha or heads % kv_heads else kv_heads)
    if isinstance(get(config, "intermediate"), (list, tuple)):  # one a layer (Gemma 3n's)
        put(c, "intermediate", [intermediate] * len(get(config, "intermediate")[:get(c, "layers") or None]))
    elif get(config, "intermediate") is not None:
        put(c, "intermediate", intermediate)
    if get(config, "head_dim") is not None:
        # latent attention (DeepSeek-V2/V3: a kv_lora_rank) rotates head_dim = its rotary part of each
        # head, kept as it is; elsewhere (DeepSeek-V4) the rotary part is a share of the whole head
        latent = config.to_dict().get("kv_lora_rank")  # (read whole: a per-layer config refuses the attribute)
        put(c, "head_dim", (get(config, "rope_head_dim") if latent else None) or hidden // heads)
    for role, size in (("expert_intermediate", 32), ("shared_intermediate", 48)):
        if get(config, role) is not None:
            put(c, role, size)
    if get(config, "dense_first") is not None:  # a layer of experts among those kept
        put(c, "dense_first", min(get(config, "dense_first"), max(get(c, "layers") - 1, 0)))
    if getattr(c, "rotary_dim", None):  # GPT-J, CodeGen: rotary on the first rotary_dim of each head
        c.rotary_dim = min(c.rotary_dim, hidden // heads)
    old_vocab = get(config, "vocab")
    put(c, "vocab", vocab)
    n_layers = get(c, "layers")  # (None where the config derives it: Nemotron-H's pattern)
    for k, v in c.to_dict().items():  # side tables (Gemma 4's per-layer embeddings: their vocabulary, width)
        if isinstance(v, int) and not isinstance(v, bool):
            if k.startswith("vocab_size_") and v > vocab:
                setattr(c, k, vocab)
            elif k.endswith("_vocab_size") and v > vocab and isinstance(old_vocab, int) \
                    and old_vocab * 15 // 16 <= v <= old_vocab:
                setattr(c, k, vocab)  # the same vocabulary unpadded (Inkling 2's head: its conversion
                #                       pads the rows from it up to vocab_size when saving)
            elif k.startswith("hidden_size_") and v > hidden:
                setattr(c, k, hidden // 4)
            elif k.startswith("num_") and k.endswith("_layers") and k != _field(c, "layers") \
                    and isinstance(n_layers, int) and v >= n_layers:
                setattr(c, k, 0)  # as many layers of a kind as the copy has (Gemma 4's that share KV: a
                #                   valid copy needs a producer of each type): none
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # published ids fall outside a small vocab
        v = getattr(c, key, None)
        ids = v if isinstance(v, list) else [v]
        if any(i is not None and i >= vocab for i in ids):
            try:
                setattr(c, key, None)
            except Exception:  # noqa: BLE001 -- a config that validates its fields wants an id (CWM's)
                setattr(c, key, 0)
    if getattr(c, "sliding_window", None):
        c.sliding_window = min(c.sliding_window, 64)
    if getattr(c, "attention_chunk_size", None):  # a check's few positions cross a chunk's end
        c.attention_chunk_size = min(c.attention_chunk_size, 6)
    rederive(c, config)
    rescale_overrides(config, c)
    return c


def rederive(c, original=None) -> None:
    """Recompute in place what `c`'s class derives from its other fields, after they changed
    (`original`: the config `c` was copied from).

    A config's __post_init__ sets attributes that are not fields from those that are (Zamba2's
    attention and Mamba head widths from hidden_size, its hybrid layers' ids from the layer
    pattern), and fills fields left None the same way (Zamba's attention width, Mamba's time-step
    rank); a copy keeps them as they were. A 64-wide copy kept the published 640-wide Mamba heads
    and could not run. The family's own class makes them again, of what the copy left as
    `original` had it: every attribute that is not a field, and each number field `original`'s
    class derives (made without it, it comes out the same). Lists and tables stay: a list with a
    value a layer is indexed by the copy's layers as by the original's (SmolLM3's rotary-free
    fourth layer, which one made again for two layers loses when `init --layers 8` grows the
    copy), and a table such as rope_parameters holds the family's constants."""
    if not dataclasses.is_dataclass(type(c)):
        return
    with _quiet():  # the probes below are not the user's configs: their complaints are not news
        _rederive(c, original)


@contextlib.contextmanager
def _quiet():
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _rederive(c, original) -> None:
    cls = type(c)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    now = c.to_dict()
    fields = {k: v for k, v in now.items() if k in names}
    derived = set()
    if original is not None and type(original) is cls:
        was = {k: v for k, v in original.to_dict().items() if k in names}
        for k, v in fields.items():
            if k not in was or v != was[k] or v is None:
                continue  # set by the copy, or nothing to derive
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue  # numbers only (see above)
            try:
                if cls(**{f: x for f, x in was.items() if f != k}).to_dict().get(k) == v:
                    derived.add(k)
            except Exception:  # noqa: BLE001 -- the class wants it given
                pass
    made = {}
    try:
        fresh = cls(**{k: v for k, v in fields.items() if k not in derived})
        before = original.to_dict() if original is not None else now
        made = {k: (getattr(fresh, k), v) for k, v in fresh.to_dict().items()
                if (k not in names or k in derived) and not k.startswith("_") and k in now
                and now[k] == before.get(k)}  # (what the copy set is its own)
    except Exception:  # noqa: BLE001 -- a class that will not make itself from its fields: left as it is
        pass
    for k, (value, as_dict) in made.items():
        if as_dict == now[k]:
            continue
        try:
            setattr(c, k, value)
        except Exception:  # noqa: BLE001 -- a property without a setter: derived when read anyway
            pass


def rescale_overrides(config, c) -> None:
    """After `c`'s shapes were changed from `config`'s: a layer's own values keep their ratio to the
    global value (Gemma 4's global layers: twice the head dim, fewer KV heads), KV heads still
    dividing the heads."""
    table = overrides(c)
    if not table:
        return
    roles = {f: r for r in ("heads", "kv_heads", "head_dim", "intermediate", "expert_intermediate")
             for f in ROLES[r]}
    heads = get(c, "heads")
    for ov in table.values():
        for f, v in list(ov.items()):
            if f not in roles or not isinstance(v, int) or not _read(config, f):
                continue
            new = max(1, v * get(c, roles[f]) // _read(config, f))
            if roles[f] == "kv_heads" and heads % new:
                new = 1
            ov[f] = new
    _set_overrides(c, table)


def kv_geometry(config) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(layers, (heads, dim) of what a layer caches as keys, the same of its values) of an HF
    config, for the layers without values of their own (`layer_kv_geometry` for one layer). Latent
    attention (DeepSeek-V3) caches its compressed KV (kv_lora_rank wide) as the "keys" and the
    rotary part of its keys as the "values", each one head, and expands them after reading the cache."""
    layers = config.num_hidden_layers
    latent = get(config, "latent_kv")
    if latent:
        return layers, (1, latent), (1, get(config, "rope_head_dim"))
    heads = config.num_attention_heads
    kv = _read(config, "num_key_value_heads") or heads
    hd = _read(config, "head_dim") or config.hidden_size // heads
    # values narrower or wider than keys where the family says so (MiMo-V2-Flash's v_head_dim)
    return layers, (kv, hd), (kv, _read(config, "v_head_dim") or hd)


def layer_kv_geometry(config, i: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((heads, dim) of layer i's cached keys, the same of its values), as the config says
    (hf.kv_layout: as the model writes them)."""
    return kv_geometry(layer_config(config, i))[1:]

