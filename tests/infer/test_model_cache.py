"""Families whose layers keep what tierlm's slot cache does not hold (DeepSeek-V4's compressed
attention) or that take no cache but their own (MiniMax) generate on the cache the model makes
itself, a sequence a slot: its bytes measured on `meta` as a real run holds them, prompts in chunks
where the load-time check found them to continue, slots compacted as sequences finish, and each
greedy token equal to transformers' generate."""
import pytest
import torch

from tests.families import family_config
from tests.infer.test_generate import _Tok, _engine, _reference
from tierlm.infer.batcher import Batcher, Request
from tierlm.infer.model_cache import ModelCaches, returned_cache, slot_bytes, tensor_bytes
from tierlm.infer.sampling import SamplingParams
from tierlm.storage import BudgetError

FAMS = ["deepseek_v4", "minimax"]


def _model(fam):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(fam, initializer_range=0.3)).float().eval()


@pytest.mark.parametrize("fam", FAMS)
def test_a_slots_bytes_measured_on_meta_are_what_a_real_run_holds(fam):
    model = _model(fam)
    for n in (5, 16, 33):  # inside DeepSeek-V4's window of 6, past it, and past several compressed blocks
        with torch.no_grad():
            cache = returned_cache(model(torch.randint(0, 128, (1, n - 1)), use_cache=True))
            held = tensor_bytes(cache)
            model(torch.randint(0, 128, (1, 1)), use_cache=True, cache=cache)
            held = max(held, tensor_bytes(cache))
        assert slot_bytes(model.config, n, torch.float32) == held > 0
    # bf16 elements counted at the engine's width; fp32 states as they are
    assert slot_bytes(model.config, 33, torch.bfloat16) < slot_bytes(model.config, 33, torch.float32)


@pytest.mark.parametrize("fam", FAMS)
def test_generating_on_the_models_own_cache_equals_transformers(fam, tmp_path):
    model = _model(fam)
    d = tmp_path / "model"
    model.save_pretrained(d)
    # prompts longer than a step's 8 tokens: fed in chunks where they continue (DeepSeek-V4), whole
    # where the check found a chunk does not (MiniMax's masks read its lightning first layer's
    # cache, which keeps no keys)
    prompts = [list(range(3, 20)), [5, 9, 2], list(range(40, 50)), [77, 1, 64, 9]]
    new = [6, 2, 4, 3]  # sequences finish at different steps: slots are compacted under the others
    refs = [_reference(model, p, n) for p, n in zip(prompts, new)]
    eng = _engine(d, tmp_path, max_batch=3, max_seq_len=40, step_tokens=8 if fam == "deepseek_v4" else 24)
    try:
        assert isinstance(eng.cache, ModelCaches) and eng.lean is None
        assert eng.whole_prompts == (fam == "minimax")
        assert "the model makes and the rows of a step run one at a time" in eng.decode_path()
        assert eng.placement.kv == 3 * slot_bytes(eng.config, 40, torch.float32) and \
            eng.placement.kv_name == "the model's own cache"
        b = Batcher(eng, _Tok(), [])
        reqs = [b.submit(Request(p, SamplingParams(max_tokens=n))) for p, n in zip(prompts, new)]
        b.run_until_idle()
        assert [r.out_ids for r in reqs] == refs
        with pytest.raises(BudgetError, match="each cache slot holds 40"):
            b.submit(Request(list(range(20)), SamplingParams(max_tokens=30)))
    finally:
        eng.close()
    if fam == "minimax":  # a prompt longer than a step cannot go in chunks: refused, naming the fix
        eng = _engine(d, tmp_path, max_batch=2, max_seq_len=40, step_tokens=8)
        try:
            with pytest.raises(BudgetError, match="minimax's layers cannot continue a prompt fed in chunks"):
                Batcher(eng, _Tok(), []).submit(Request(list(range(3, 20)), SamplingParams(max_tokens=2)))
        finally:
            eng.close()


def test_a_slot_continues_only_where_it_stands():
    caches = ModelCaches(2, 16, 100)
    assert caches.take(0, 0, 5) is None and caches.nbytes == 200
    caches.keep(0, "made")
    assert caches.take(0, 5, 1) == "made"
    with pytest.raises(ValueError, match="slot 0 holds 6 positions; a step cannot continue it at 3"):
        caches.take(0, 3, 1)
    caches.move(0, 1, 6)
    assert caches.caches == [None, "made"] and caches.lengths == [0, 6]
    assert caches.take(1, 0, 2) is None  # a new sequence starts afresh
