"""Packed steps: rows of different lengths run as one unpadded sequence and compute what each
row's own forward computes."""
import pytest
import torch

from tierlm.infer.engine import InferConfig, InferenceEngine

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
    return InferenceEngine(d, cfg, library_rss=0)


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


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt2"])
def test_packed_steps_equal_each_rows_own_forward(arch, make_model_dir, tmp_path):
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


def test_padded_steps_still_run_and_agree(make_model_dir, tmp_path):
    """`packed=False` pads every row to the longest (the old step): same logits, more tokens."""
    d, _ = make_model_dir("qwen2", **SPREAD, **OVER["qwen2"])
    out = {}
    for packed in (True, False):
        eng = _engine(d, tmp_path, packed)
        try:
            out[packed] = _run(eng)
        finally:
            eng.close()
    for a, b in zip(out[True][0], out[False][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert out[False][1] == [len(s) * max(map(len, s)) for s in STEPS]
    assert sum(out[True][1]) < sum(out[False][1])
