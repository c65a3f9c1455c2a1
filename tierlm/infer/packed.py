"""Packed steps: a step whose rows feed different numbers of tokens runs them as one sequence.

Continuous batching mixes a new request's prompt chunk (hundreds of tokens) with the running
requests' one token each. Padding every row to the longest would multiply the step's compute by
the number of rows: 7 decoding rows beside a 256-token chunk computed 8 x 256 tokens. A packed
step feeds the rows' tokens side by side as one row of sum(lengths) tokens: the linear layers,
most of the compute, see each real token once. Only attention needs the rows apart: each token
attends to its own KV slot, so the attention function below splits the packed queries by row and
runs the attention per row against that slot's keys (what the cache's `update` returns in a
packed step).

transformers' attention modules look their attention function up by name at every forward
(`config._attn_implementation`); the engine names this one, which runs transformers' own SDPA
function unchanged whenever the step is not packed. Where SDPA cannot compute what the model
computes (attention-logit soft-capping, attention sinks, a model that declares no SDPA support),
the model's own eager attention function runs instead, with the step's boolean masks turned into
the additive ones it expects.

A model whose attention does not dispatch through transformers' AttentionInterface (Falcon
computes its attention inline), or computes something else under a name that is not "sdpa" or
"eager" (DeepSeek-V3.2's sparse attention), runs transformers' own function by name: SDPA, which
takes the boolean masks as they are, or for the latter eager, given additive masks; its steps are
padded, never packed (`install` returns False).
"""
from __future__ import annotations

import functools
import inspect
import re
import sys

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "tierlm_rows"
# keyword arguments the attention modules pass that SDPA has no way to apply: when one is set, the
# model's eager attention runs (SDPA would ignore it and compute something else)
SDPA_CANNOT = ("softcap", "s_aux")


def _module_of(obj):
    return sys.modules.get(type(obj).__module__)


def dispatches_by_name(attn) -> bool:
    """Whether an attention module looks its attention function up in transformers'
    AttentionInterface (its modeling module imports the registry), so that `rows_attention` runs."""
    return hasattr(_module_of(attn), "ALL_ATTENTION_FUNCTIONS")


def attention_modules(model) -> list:
    """The modules that keep a KV cache: transformers' attention classes, each knowing its layer
    (LongCat-Flash's latent attention is called ...MLA; GPT-Neo's knows it as layer_id, and its
    wrapper, which knows it too, is left out for the self-attention inside that writes the cache)."""
    named = lambda m: type(m).__name__.endswith(("Attention", "MLA"))  # noqa: E731
    out = [m for m in model.modules() if hasattr(m, "layer_idx") and named(m)]
    # (one that writes a cache, not RWKV's, whose state is an object of its own)
    by_id = [m for m in model.modules() if not hasattr(m, "layer_idx") and hasattr(m, "layer_id") and named(m)
             and _writes_cache(type(m))]
    ids = {id(m) for m in by_id}
    return out + [m for m in by_id if not any(id(c) in ids for c in m.modules() if c is not m)]


@functools.cache
def _writes_cache(cls) -> bool:
    """An attention class whose forward hands its keys and values to a cache's `update`."""
    try:
        return ".update(" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


_memo: list = [None, None, None]  # (boolean mask, dtype, additive mask): every layer of a step shares one


def _additive(mask: torch.Tensor | None, query: torch.Tensor, keys: int) -> torch.Tensor | None:
    """The eager functions add their mask to the scores: 0 where a query attends, the dtype's
    minimum where it does not. Without a mask (a forward without the cache, q > 1) SDPA would be
    told is_causal; eager needs the causal mask made."""
    if mask is None:
        q = query.shape[2]
        if q == 1:
            return None
        dev = query.device
        mask = torch.arange(keys, device=dev)[None, :] <= torch.arange(keys - q, keys, device=dev)[:, None]
    if mask.dtype != torch.bool:
        return mask.to(query.dtype)
    if _memo[0] is mask and _memo[1] == query.dtype:
        return _memo[2]
    add = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device)
    add.masked_fill_(~mask, torch.finfo(query.dtype).min)
    _memo[:] = [mask, query.dtype, add]
    return add


def _attend(module, query, key, value, mask, **kwargs):
    eager = getattr(module, "_tierlm_eager", None)
    if eager is not None and (getattr(module, "_tierlm_no_sdpa", False) or
                              any(kwargs.get(k) is not None for k in SDPA_CANNOT)):
        return eager(module, query, key, value, _additive(mask, query, key.shape[2]), **kwargs)
    if _chunks(query, key, value, mask, kwargs):
        return _chunked(query, key, value, mask, kwargs.get("scaling")), None
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


# Prompt rows attend in chunks of this many queries, each to the keys its mask lets it see
CHUNK = 64
_bounds_memo: list = [None, None]  # (boolean mask, [(start, end, first key, last key + 1)]): a step's layers share one


def _chunks(query, key, value, mask, kwargs) -> bool:
    """Whether this call runs in query chunks: many queries (a prompt) on the CPU, a boolean mask,
    and nothing SDPA is told besides the mask and the scale. PyTorch's CPU SDPA computes every
    query against every key it is given and masks afterwards: a 512-token prompt's causal half was
    computed and thrown away (18 ms a layer of TinyLlama-1.1B's against 11 in chunks, 2 threads)."""
    return (query.device.type == "cpu" and query.shape[2] >= 2 * CHUNK and mask is not None
            and mask.dtype == torch.bool and mask.dim() == 4 and not kwargs.get("dropout")
            and kwargs.get("position_bias") is None and query.shape[-1] == key.shape[-1] == value.shape[-1])


def _bounds(mask: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Each chunk of queries' rows and the range of keys any of them attends to."""
    if _bounds_memo[0] is mask:
        return _bounds_memo[1]
    q, keys = mask.shape[-2], mask.shape[-1]
    seen = mask.reshape(-1, q, keys).any(0)  # [q, keys]: attended by this query in some row or head
    out = []
    for s in range(0, q, CHUNK):
        e = min(q, s + CHUNK)
        cols = seen[s:e].any(0).nonzero()
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if len(cols) else (0, keys)  # none: as unchunked
        out.append((s, e, lo, hi))
    _bounds_memo[:] = [mask, out]
    return out


def _chunked(query, key, value, mask, scaling) -> torch.Tensor:
    """SDPA over chunks of queries, each against its keys only; [B, q, heads, d] as
    transformers' SDPA function returns it. Keys no query of a chunk attends to are left out, so
    the result is the same maths, rounded in another order."""
    gqa = query.shape[1] != key.shape[1]
    outs = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, lo:hi], value[:, :, lo:hi],
                                           attn_mask=mask[..., s:e, lo:hi], scale=scaling, enable_gqa=gqa)
            for s, e, lo, hi in _bounds(mask)]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def rows_attention(module, query, key, value, attention_mask, **kwargs):
    """query [1, heads, T, d] of a packed step against key/value [rows, kv heads, L, d] (slot b's
    cache); any other call is transformers' SDPA attention (or the model's eager one) as is."""
    cache = getattr(module, "_tierlm_cache", None)
    rows = cache.segments if cache is not None else None
    if rows is None or query.shape[0] == key.shape[0]:
        return _attend(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for b, (off, n, end) in enumerate(rows):
        mask = attention_mask[:, :, off:off + n, :end] if attention_mask is not None else None
        o, _ = _attend(module, query[:, :, off:off + n], key[b:b + 1, :, :end],
                       value[b:b + 1, :, :end], mask, **kwargs)
        outs.append(o)  # [1, n, heads, d]
    return torch.cat(outs, dim=1), None


def packs(model) -> bool:
    """Whether steps of this model can run packed: its attention dispatches by name, and computes
    the same under any name."""
    mods = attention_modules(model)
    return all(dispatches_by_name(m) for m in mods) and not any(_sdpa_apart(type(m)) for m in mods)


_SDPA_BRANCH = re.compile(r"""_attn_implementation\s*(==|in)\s*\(?[^)\n]*["']sdpa["']""")


def runs_eager(model) -> bool:
    """Whether a step's attention runs the model's eager function (all scores at once in the
    compute dtype, additive masks: plan.inference.scratch_bytes counts them): a model without SDPA
    (soft-capping, sinks), one that computes apart under tierlm's name, or one whose own inline
    attention adds the mask to its scores (install)."""
    mods = attention_modules(model)
    if not mods:
        return False
    if not getattr(model, "_supports_sdpa", True):
        return True
    return not packs(model) and _eager_by_name(mods)


def _eager_by_name(mods) -> bool:
    """Whether a model that does not pack runs with its implementation named "eager": one that
    dispatches by name but computes apart under tierlm's name (transformers' eager function
    computes all it asks), or one whose attention computes inline and adds the mask to its scores
    (XGLM: a boolean mask added there is 0 and 1, not 0 and -inf; under "eager" the steps give
    additive masks)."""
    by_name = all(dispatches_by_name(m) for m in mods)
    return (by_name and any(_sdpa_apart(type(m)) for m in mods)) or \
        (not any(dispatches_by_name(m) for m in mods) and any(_adds_mask_inline(type(m)) for m in mods))


_ADDS_MASK = re.compile(r"\+\s*attention_mask\b")


@functools.cache
def _adds_mask_inline(cls) -> bool:
    """An attention class that adds the mask to its scores itself and has no SDPA branch of its own
    (Falcon's, named "sdpa", takes boolean masks)."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return bool(_ADDS_MASK.search(src)) and not _SDPA_BRANCH.search(src)


@functools.cache
def _sdpa_apart(cls) -> bool:
    """Whether an attention class computes something else unless its implementation is named
    "sdpa" (or "eager"): DeepSeek-V3.2's sparse attention puts its indexer's choice of keys into
    the mask only under those names, and hands it to a kernel under any other. Such a model runs
    on padded rows under transformers' own name (install: eager where it dispatches by name)."""
    try:
        return bool(_SDPA_BRANCH.search(inspect.getsource(cls.forward)))
    except (OSError, TypeError):
        return False


def use_defaults(model, config) -> None:
    """Run the model's attention and mask creation as transformers does by default: SDPA where the
    class supports it, else eager (for a model that makes its own masks: infer.generic)."""
    name = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
    for c in {id(config): config, id(model.config): model.config}.values():
        c._attn_implementation = name


def install(model, config, cache) -> bool:
    """Route the model's attention through `rows_attention`, which reads `cache.segments`; returns
    whether steps may be packed (False: the model's attention does not dispatch by name, and runs
    its own SDPA branch on padded rows)."""
    mods = attention_modules(model)
    if not packs(model):
        # a model that dispatches by name but computes something else under ours runs transformers'
        # eager attention, the one function that computes all it asks (sinks too), with additive
        # masks (GenericStep), as does one whose inline attention adds its mask (XGLM); one with an
        # inline SDPA branch (Falcon, whose own branch is named "sdpa") keeps SDPA
        # (and one whose class never runs SDPA, MPT's, whose masks are then additive: it turns them
        # to booleans True where masked)
        name = "eager" if _eager_by_name(mods) or not getattr(model, "_supports_sdpa", True) else "sdpa"
        for c in {id(config): config, id(model.config): model.config}.values():
            c._attn_implementation = name
        return False
    AttentionInterface.register(NAME, rows_attention)
    # a forward without the engine's masks (perplexity) has transformers make them: boolean, as
    # for SDPA, sliding windows included (a name without a mask function got none)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    for c in {id(config): config, id(model.config): model.config}.values():
        c._attn_implementation = NAME
    no_sdpa = not getattr(model, "_supports_sdpa", True)
    for m in mods:
        m._tierlm_cache = cache
        m._tierlm_eager = getattr(_module_of(m), "eager_attention_forward", None)
        m._tierlm_no_sdpa = no_sdpa
    return True
