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
computes its attention inline) keeps its own SDPA branch, which takes the boolean masks as they
are; its steps are padded, never packed (`install` returns False).
"""
from __future__ import annotations

import sys

import torch
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
    """The modules that keep a KV cache: transformers' attention classes, each knowing its layer."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]


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
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


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
    """Whether steps of this model can run packed: its attention dispatches by name."""
    return all(dispatches_by_name(m) for m in attention_modules(model))


def install(model, config, cache) -> bool:
    """Route the model's attention through `rows_attention`, which reads `cache.segments`; returns
    whether steps may be packed (False: the model's attention does not dispatch by name, and runs
    its own SDPA branch on padded rows)."""
    mods = attention_modules(model)
    if not packs(model):
        for c in {id(config): config, id(model.config): model.config}.values():
            c._attn_implementation = "sdpa"
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
