"""What each layer's KV cache holds a token, as the model writes it.

The model's own forward on `meta` (hf.meta_forward) gives each attention layer's keys and values
as its modules pass them to `cache.update`: the KV cache is allocated, budgeted and planned from
that, so a layer that keeps more or fewer heads than its config says (MiMo-V2-Flash's sliding
layers: twice the config's; GPT-BigCode's and Falcon's multi-query attention: one) is sized right
before anything is allocated. Where the forward cannot run on `meta` (a mixture that routes by
data-dependent shapes: DBRX, JetMoE), or the config is a planning shape and not a model's,
the config's fields say (hf.fields.kv_geometry). A layer that stores nothing (it attends with an
earlier layer's keys) is given no cache.
"""
from __future__ import annotations

from . import fields, meta_forward


def measured(config) -> meta_forward.Record | None:
    """The record of `config`'s model's forward on `meta`, or None where there is none to run (a
    planning shape's namespace) or it fails there."""
    if not hasattr(config, "to_json_string") or not hasattr(config, "model_type"):
        return None
    try:
        return meta_forward.record(config, attends=True)
    except Exception:  # noqa: BLE001 -- then the config's fields say, as they did before
        return None


def layer_kv_geometry(config, i: int, rec: meta_forward.Record | None = None):
    """((heads, dim) of layer i's cached keys, the same of its values); `rec`: `measured(config)`,
    where the caller has it."""
    rec = measured(config) if rec is None else rec
    if rec is not None and i in rec.kv:
        return rec.kv[i]
    return fields.layer_kv_geometry(config, i)


def index_key(config, i: int, rec: meta_forward.Record | None = None) -> int:
    """The width of the key a sparse-attention indexer keeps a token at layer i (0: none)."""
    rec = measured(config) if rec is None else rec
    if rec is not None and i in rec.index_keys:
        return rec.index_keys[i]
    # (an indexer may pass over a sequence as short as the probe's: the config says)
    return fields.layer_get(config, "index_key", i, 0)


def caching_layers(config, layers=None, rec: meta_forward.Record | None = None) -> list[int]:
    """Of `layers` (all), those that keep keys and values: where the forward on `meta` ran, the
    layers that stored some. A layer that attends with an earlier layer's keys (Gemma 4's shared-KV
    layers) stores none and needs no cache of its own."""
    rec = measured(config) if rec is None else rec
    every = range(config.num_hidden_layers) if layers is None else layers
    return [i for i in every if rec is None or i in rec.kv]


def kv_token_bytes(config, layers=None, element: int = 1) -> int:
    """Elements (times `element` bytes) one token's keys and values take over `layers` (all), with
    the indexer's key where the layers' sparse attention keeps one (DeepSeek-V3.2's DSA)."""
    rec = measured(config)
    total = 0
    for i in caching_layers(config, layers, rec):
        (kh, kd), (vh, vd) = layer_kv_geometry(config, i, rec)
        total += kh * kd + vh * vd + index_key(config, i, rec)
    return total * element
