"""Greedy generation equals transformers' generate token for token (fp32), resident or streamed."""
import pytest
import torch

from tierlm.infer.batcher import Batcher, Request
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.sampling import SamplingParams
from tierlm.storage import BudgetError
from ..memory import held_now

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]
# A wider init than the default 0.02 gives peaked, varied next-token distributions, so a
# mismatch shows up as different tokens instead of every model repeating one token.
SPREAD = {"initializer_range": 0.3}
NEW = 16


class _Tok:
    """Just enough of a tokenizer for the batcher when the test speaks in ids."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _engine(d, tmp_path, **kw):
    kw.setdefault("cpu_mem", "1GiB")
    return InferenceEngine(d, InferConfig(dtype="fp32", nvme_dir=str(tmp_path / "nvme"), **kw), library_rss=held_now())


def _greedy(eng, prompts, new=NEW):
    b = Batcher(eng, _Tok(), [])
    reqs = [b.submit(Request(list(p), SamplingParams(max_tokens=new))) for p in prompts]
    b.run_until_idle()
    return [r.out_ids for r in reqs]


def _reference(model, prompt, new=NEW):
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 9, 17, 3, 44], [100, 7], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 1]]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_resident_and_streamed(arch, make_model_dir, tmp_path):
    d, model = make_model_dir(arch, **SPREAD)
    refs = [_reference(model, p) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) > 1 and any(len(set(r)) > 3 for r in refs)  # a real test
    for resident in (None, 0, 1):
        eng = _engine(d, tmp_path, max_batch=1, max_seq_len=40, resident_layers=resident)
        if resident == 0:
            assert eng.placement.streamed == eng.placement.layers and eng.stream is not None
        try:
            got = [_greedy(eng, [p])[0] for p in PROMPTS]
        finally:
            eng.close()
        assert got == refs, f"{arch}, resident_layers={resident}"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_continuous_batch_equals_one_at_a_time(arch, make_model_dir, tmp_path):
    """Sequences of different lengths sharing steps (joining and leaving the batch, prompts
    prefilled in chunks) produce what each produces alone."""
    d, model = make_model_dir(arch, **SPREAD)
    prompts = PROMPTS + [[3] * 9, [60, 61, 62]]
    refs = [_reference(model, p, 10) for p in prompts]
    eng = _engine(d, tmp_path, max_batch=3, max_seq_len=40, step_tokens=4, resident_layers=1)
    try:
        b = Batcher(eng, _Tok(), [])
        lens = [10, 4, 10, 7, 10]
        reqs = [b.submit(Request(list(p), SamplingParams(max_tokens=n))) for p, n in zip(prompts, lens)]
        b.run_until_idle()
    finally:
        eng.close()
    assert [r.out_ids for r in reqs] == [ref[:n] for ref, n in zip(refs, lens)]
    assert [r.finish_reason for r in reqs] == ["length"] * 5


def test_store_is_written_once_and_reused(make_model_dir, tmp_path):
    d, _ = make_model_dir("llama", **SPREAD)
    eng = _engine(d, tmp_path, resident_layers=0)
    first = eng.store_written
    out1 = _greedy(eng, [PROMPTS[0]])
    eng.close()
    eng = _engine(d, tmp_path, resident_layers=0)
    try:
        assert first > 0 and eng.store_written == 0
        assert _greedy(eng, [PROMPTS[0]]) == out1
        assert eng.ssd_bytes_read() > 0
    finally:
        eng.close()


def test_request_longer_than_a_kv_slot_is_refused(make_model_dir, tmp_path):
    d, _ = make_model_dir("llama")
    eng = _engine(d, tmp_path, max_seq_len=16)
    try:
        b = Batcher(eng, _Tok(), [])
        with pytest.raises(BudgetError, match="raise --max-seq-len"):
            b.submit(Request(list(range(10)), SamplingParams(max_tokens=7)))
        b.submit(Request(list(range(10)), SamplingParams(max_tokens=6)))  # exactly fits
        b.run_until_idle()
    finally:
        eng.close()


def test_budget_too_small_names_the_need_and_the_flags(make_model_dir, tmp_path):
    d, _ = make_model_dir("llama")
    with pytest.raises(BudgetError, match=r"--cpu-mem .* cannot run this model.*Raise --cpu-mem to"):
        InferenceEngine(d, InferConfig(cpu_mem="1MiB", dtype="fp32", nvme_dir=str(tmp_path / "n")),
                        library_rss=held_now())
