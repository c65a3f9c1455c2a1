"""Sparse attention's indexer keys (DeepSeek-V3.2's DSA) in the KV cache: planned, allocated and
written per row as the layers' keys are. Greedy decoding against transformers is
tests/test_families.py's (deepseek_v32, glm_moe_dsa)."""
import torch

from tests.families import family_config
from tierlm.hf.kv_layout import kv_token_bytes
from tierlm.infer.kvcache import SlotKVCache, kv_bytes


def test_the_budget_counts_the_indexer_keys_the_cache_allocates():
    cfg = family_config("deepseek_v32")
    latent, rope, index = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    assert kv_token_bytes(cfg) == cfg.num_hidden_layers * (latent + rope + index)
    cache = SlotKVCache(cfg, slots=3, max_len=10, dtype=torch.float32)
    held = sum(t.numel() * t.element_size() for t in cache.k + cache.v + cache.ik if t is not None)
    assert cache.indexed and cache.nbytes == held == kv_bytes(cfg, 3, 10, torch.float32)


def test_indexer_keys_go_to_each_rows_positions():
    cfg = family_config("deepseek_v32")
    cache = SlotKVCache(cfg, slots=2, max_len=8, dtype=torch.float32)
    d = cfg.index_head_dim
    cache.begin_step([0, 0], [3, 1])                     # two prompts: 3 tokens and 1 (padded)
    k = torch.arange(2 * 3 * d, dtype=torch.float32).view(2, 3, d)
    got = cache.update_indexer(k, 0)
    assert got.shape == (2, 3, d)
    assert torch.equal(got[0], k[0]) and torch.equal(got[1, :1], k[1, :1])
    cache.begin_step([3, 1], [1, 1])                     # one token each, at positions 3 and 1
    new = torch.full((2, 1, d), -1.0)
    got = cache.update_indexer(new, 0)
    assert torch.equal(got[0, 3], new[0, 0]) and torch.equal(got[1, 1], new[1, 0])
    assert torch.equal(got[0, :3], k[0])                 # earlier keys kept
    cache.move(0, 1, 4)                                  # compaction carries them
    assert torch.equal(cache.ik[0][1, :4], cache.ik[0][0, :4])
