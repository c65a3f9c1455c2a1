"""Packed steps: rows of different lengths run as one unpadded sequence and compute what each
row's own forward computes."""
import pytest
import torch

from tierlm.infer import packed
from tierlm.infer.engine import InferConfig, InferenceEngine
from ..memory import held_now

SPREAD = {"initializer_range": 0.3}
# sliding windows shorter than the sequences, so the per-layer masks matter
OVER = {
    "llama": {},
    "gpt2": {},
    "mistral": {"sliding_window": 4},
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
}
# (row, tokens) of each step: a new prompt in chunks beside rows that decode one token a step,
# rows that prefill together, and rows that join later (their slots start empty)
STEPS = [
    [[5, 9, 17, 3, 44, 8, 2]],
    [[11], [100, 7, 31]],
    [[12], [40], [60, 61, 62, 63, 64, 65]],
    [[13], [41, 42], [66]],
    [[14], [43], [67], [3, 3, 3, 3, 9]],
]


def _engine(d, tmp_path, packed, resident=None):
    cfg = InferConfig(dtype="fp32", cpu_mem="1GiB", nvme_dir=str(tmp_path / "nvme"), max_batch=4,
                      max_seq_len=40, packed=packed, resident_layers=resident)
    return InferenceEngine(d, cfg, library_rss=held_now())


def _run(eng):
    """Every step's logits, and the tokens the first decoder layer's MLP saw in each step."""
    seen = []
    mlp = eng.blocks[1].module.mlp
    mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0] * a[0].shape[1]))
    fed = [0] * 4
    out = []
    for step in STEPS:
        out.append(eng.step(step, fed[:len(step)]))
        for b, t in enumerate(step):
            fed[b] += len(t)
    return out, seen


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt2"])
def test_packed_steps_equal_each_rows_own_forward(arch, chunk, make_model_dir, tmp_path, monkeypatch):
    """chunk 2: every prompt chunk of 4 tokens or more attends in query chunks of 2 (as a long
    prompt does in chunks of packed.CHUNK), sliding windows and rows beside it included."""
    if chunk:
        monkeypatch.setattr(packed, "CHUNK", chunk)
    d, model = make_model_dir(arch, **SPREAD, **OVER[arch])
    eng = _engine(d, tmp_path, packed=True, resident=1)
    try:
        got, seen = _run(eng)
    finally:
        eng.close()
    history = [[] for _ in range(4)]
    for step, logits in zip(STEPS, got):
        for b, t in enumerate(step):
            history[b] += t
            with torch.no_grad():
                ref = model(torch.tensor([history[b]])).logits[0, -1]
            # the padded step errs by up to 3e-5 here too (logits of ~10; attention over the cache
            # sums in another order); a wrong slot, position or mask errs by the logits' size
            torch.testing.assert_close(logits[b], ref, rtol=1e-5, atol=1e-4, msg=f"{arch} row {b}")
    # the mixed steps ran unpadded (a one-row step and rows of equal length have no padding;
    # rows of one token each may take the lean path, which has no MLP module call)
    want = [sum(map(len, s)) for s in STEPS]
    assert seen == want[:len(seen)] and len(seen) == len(STEPS), (seen, want)


@pytest.mark.parametrize("chunk", [None, 2])
def test_padded_steps_still_run_and_agree(chunk, make_model_dir, tmp_path, monkeypatch):
    """`packed=False` pads every row to the longest (the old step): same logits, more tokens."""
    if chunk:
        monkeypatch.setattr(packed, "CHUNK", chunk)
    d, _ = make_model_dir("qwen2", **SPREAD, **OVER["qwen2"])
    out = {}
    for pack in (True, False):
        eng = _engine(d, tmp_path, pack)
        try:
            out[pack] = _run(eng)
        finally:
            eng.close()
    for a, b in zip(out[True][0], out[False][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert out[False][1] == [len(s) * max(map(len, s)) for s in STEPS]
    assert sum(out[True][1]) < sum(out[False][1])


def _masks(rows: int, q: int, keys: int) -> dict:
    """Boolean [rows, 1, q, keys] masks as the KV cache makes them: row b's queries at the end of its
    keys (a prefix already cached), causal, a sliding window, and a short row padded (its padding
    repeats its last position)."""
    k = torch.arange(keys)
    out = {}
    pos = torch.arange(keys - q, keys)[None].expand(rows, q)
    out["causal after a prefix"] = k[None, None] <= pos[..., None]
    out["sliding window 37"] = out["causal after a prefix"] & (k[None, None] > pos[..., None] - 37)
    short = pos.clone()
    short[1, 50:] = short[1, 49]
    out["a padded row"] = k[None, None] <= short[..., None]
    return {name: m[:, None] for name, m in out.items()}


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
def test_chunked_attention_is_sdpa_over_the_keys_each_chunk_sees(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    rows, q, keys, d = 2, 150, 170, 16
    query = torch.randn(rows, heads, q, d, generator=g)
    key, value = (torch.randn(rows, kv_heads, keys, d, generator=g) for _ in range(2))
    full_k, full_v = (t.repeat_interleave(heads // kv_heads, 1) for t in (key, value))
    for name, mask in _masks(rows, q, keys).items():
        assert packed._chunks(query, key, value, mask, {"scaling": 0.3})
        ref = torch.nn.functional.scaled_dot_product_attention(query, full_k, full_v, attn_mask=mask, scale=0.3)
        got = packed._chunked(query, key, value, mask, 0.3)
        torch.testing.assert_close(got, ref.transpose(1, 2), rtol=1e-5, atol=1e-5, msg=name)
        bounds = packed._bounds(mask)
        assert [(s, e) for s, e, _, _ in bounds] == [(0, 64), (64, 128), (128, 150)]
        # the first chunk sees the prefix and its own 64 positions, not the 86 keys after them
        assert bounds[0][3] == keys - q + 64, name
        if "sliding" in name:
            assert bounds[-1][2] == keys - q + 128 - 36  # keys before the window are left out too


def test_short_steps_and_decode_are_not_chunked():
    q = torch.zeros(1, 4, 100, 8)
    kv = torch.zeros(1, 4, 100, 8)
    mask = torch.ones(1, 1, 100, 100, dtype=torch.bool)
    assert not packed._chunks(q, kv, kv, mask, {})             # fewer than 2 x CHUNK queries
    assert not packed._chunks(q[:, :, :1], kv, kv, mask[:, :, :1], {})
    q2 = torch.zeros(1, 4, 200, 8)
    m2 = torch.ones(1, 1, 200, 100, dtype=torch.bool)
    assert packed._chunks(q2, kv, kv, m2, {})
    assert not packed._chunks(q2, kv, kv, None, {})             # no mask: SDPA's own causal path
    assert not packed._chunks(q2, kv, kv, m2.float(), {})       # an additive mask
    assert not packed._chunks(q2, kv, kv, m2, {"dropout": 0.1})


@pytest.mark.parametrize("fam, eager", [("llama", False), ("falcon", False), ("gemma2", True), ("gpt_oss", True),
                                        ("deepseek_v32", True), ("glm_moe_dsa", True), ("xglm", True)])
def test_the_engine_knows_which_models_attention_runs_eager(fam, eager):
    """The scratch the budget plans (plan.inference.scratch_bytes) counts eager attention's full
    scores and additive masks where it runs: no SDPA (soft-capping, sinks), or sparse attention that
    computes apart under tierlm's name, or attention computed inline that adds its mask to the
    scores (XGLM); Falcon's inline SDPA branch is not eager."""
    from tests.families import family_config
    from tierlm.hf.structure import empty_model
    assert packed.runs_eager(empty_model(family_config(fam))) is eager
