"""The KV cache sized as the model's layers write it (hf.kv_layout, from their forward on `meta`),
not as the config's fields say: where the two differ, the budget, the plan and the allocation all
take the layers' figure, and a step writes into what was allocated."""
import types

import torch

from tests.families import family_config
from tierlm.hf import fields, kv_layout
from tierlm.infer.kvcache import SlotKVCache, kv_bytes
from tierlm.plan.shapes import shape_of


def _held(cache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.k + cache.v + cache.ik if t is not None)


def _step(cfg, cache):
    """One prefill of two rows through the model's own forward on the cache."""
    from transformers import AutoModelForCausalLM
    from tierlm.hf.meta_forward import cache_kwarg
    torch.manual_seed(0)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    pos, mask = cache.begin_step([0, 0], [5, 3])
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})


def test_sliding_layers_with_twice_the_configs_heads_are_planned_and_allocated_so():
    """MiMo-V2-Flash's sliding layers keep 2 x num_key_value_heads (its modules say so; no field
    does). Planned from the config, the first write overflowed the cache and generating was refused."""
    cfg = family_config("mimo_v2_flash")
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    kv, hd, vd = cfg.num_key_value_heads, cfg.head_dim, cfg.v_head_dim
    assert fields.layer_kv_geometry(cfg, 1) == ((kv, hd), (kv, vd))           # what the config says
    assert kv_layout.layer_kv_geometry(cfg, 0) == ((kv, hd), (kv, vd))
    assert kv_layout.layer_kv_geometry(cfg, 1) == ((2 * kv, hd), (2 * kv, vd))  # what layer 1 writes
    assert kv_layout.kv_token_bytes(cfg) == kv * (hd + vd) + 2 * kv * (hd + vd)
    cache = SlotKVCache(cfg, slots=2, max_len=12, dtype=torch.float32)
    planned = kv_bytes(cfg, 2, 12, torch.float32)
    assert cache.nbytes == _held(cache) == planned
    _step(cfg, cache)
    assert cache.nbytes == _held(cache) == planned                          # nothing refitted on write
    # `tierlm plan`'s shape counts it too: the layers' mean a token
    shape = shape_of(cfg, "tiny", "test")
    assert shape.kv_elems * cfg.num_hidden_layers == kv_layout.kv_token_bytes(cfg)


def test_multi_query_attention_is_planned_at_the_one_head_it_writes():
    """GPT-BigCode's multi-query attention writes one key/value head whatever num_key_value_heads
    says: the plan had counted the config's (here 2) and the cache shrank on its first write, so
    the budget held a KV cache twice the size of the one in use."""
    cfg = family_config("gpt_bigcode")
    assert cfg.multi_query and cfg.num_key_value_heads == 2
    hd = cfg.hidden_size // cfg.num_attention_heads
    assert kv_layout.layer_kv_geometry(cfg, 0) == ((1, hd), (1, hd))
    cache = SlotKVCache(cfg, slots=2, max_len=12, dtype=torch.float32)
    planned = kv_bytes(cfg, 2, 12, torch.float32)
    assert planned == 2 * 13 * cfg.num_hidden_layers * 2 * hd * 4
    _step(cfg, cache)
    assert cache.nbytes == _held(cache) == planned


def test_the_configs_fields_say_where_the_forward_cannot_run_on_meta():
    """DBRX routes by data-dependent shapes (torch.nonzero), which `meta` cannot run; a planning
    shape's namespace has no model at all. Both are sized from the config, as before."""
    cfg = family_config("dbrx")
    assert kv_layout.measured(cfg) is None
    assert kv_layout.kv_token_bytes(cfg) == sum(kh * kd + vh * vd for (kh, kd), (vh, vd) in
                                                (fields.layer_kv_geometry(cfg, i) for i in range(2)))
    ns = types.SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    assert kv_layout.measured(ns) is None
    assert kv_layout.kv_token_bytes(ns) == 3 * 2 * 2 * 16


def test_the_forward_on_meta_runs_once_a_config():
    from tierlm.hf import meta_forward
    cfg = family_config("qwen3")
    first = kv_layout.measured(cfg)
    assert kv_layout.measured(family_config("qwen3")) is first       # the same config: kept
    other = kv_layout.measured(family_config("qwen3", num_key_value_heads=1))
    assert other is not first and other.kv[0] == ((1, 16), (1, 16))
    assert meta_forward.record(cfg, attends=True) is first


def test_layers_that_attend_with_an_earlier_layers_keys_get_no_cache():
    """Gemma 4's small shapes end in layers that reuse an earlier layer's keys and values
    (num_kv_shared_layers) and store none: they had a cache planned and allocated all the same. Generating with
    them equals transformers' (tests/infer/test_families.py)."""
    cfg = family_config("gemma4_text", num_hidden_layers=4, num_kv_shared_layers=2,
                        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
                        vocab_size_per_layer_input=128, enable_moe_block=False)
    assert kv_layout.caching_layers(cfg) == [0, 1]
    assert kv_layout.kv_token_bytes(cfg) == 2 * 2 * 16 + 2 * 1 * 32      # a sliding and a global layer
    cache = SlotKVCache(cfg, slots=2, max_len=12, dtype=torch.float32)
    assert cache.k[2] is None and cache.k[3] is None
    assert cache.nbytes == _held(cache) == kv_bytes(cfg, 2, 12, torch.float32)
