"""Packed steps: a step whose rows feed different numbers of tokens runs them as one sequence.

Continuous batching mixes a new request's prompt chunk (hundreds of tokens) with the running
requests' one token each. Padding every row to the longest would multiply the step's compute by
the number of rows: 7 decoding rows beside a 256-token chunk computed 8 x 256 tokens. A packed
step feeds the rows' tokens side by side as one row of sum(lengths) tokens: the linear layers,
most of the compute, see each real token once. Only attention needs the rows apart: each token
attends to its own KV slot, so the attention function below splits the packed queries by row and
runs SDPA per row against that slot's keys (what the cache's `update` returns in a packed step).

transformers' attention modules look their attention function up by name at every forward
(`config._attn_implementation`); the engine names this one, which runs transformers' own SDPA
function unchanged whenever the step is not packed.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "tierlm_rows"


def rows_attention(module, query, key, value, attention_mask, **kwargs):
    """query [1, heads, T, d] of a packed step against key/value [rows, kv heads, L, d] (slot b's
    cache); any other call is transformers' SDPA attention as is."""
    cache = getattr(module, "_tierlm_cache", None)
    rows = cache.segments if cache is not None else None
    if rows is None or query.shape[0] == key.shape[0]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for b, (off, n, end) in enumerate(rows):
        mask = attention_mask[:, :, off:off + n, :end] if attention_mask is not None else None
        o, _ = sdpa_attention_forward(module, query[:, :, off:off + n], key[b:b + 1, :, :end],
                                      value[b:b + 1, :, :end], mask, **kwargs)
        outs.append(o)  # [1, n, heads, d]
    return torch.cat(outs, dim=1), None


def install(model, config, cache) -> None:
    """Route the model's attention through `rows_attention`, which reads `cache.segments`."""
    AttentionInterface.register(NAME, rows_attention)
    config._attn_implementation = NAME
    for m in model.modules():
        if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention"):
            m._tierlm_cache = cache
