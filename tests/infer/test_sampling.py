"""The one sampler (tierlm.infer.sampling): greedy is the argmax, a seed repeats its draws, top-k and
top-p limit what can be drawn, and `generate_ids` (the fine-tuning run's sample) draws the tokens the
batcher's `choose` draws from the same logits and seed."""
import pytest
import torch

from tierlm.infer.sampling import SamplingParams, choose, choose_rows, generate_ids, make_generator

VOCAB = 300


def _logits(rows=None, seed=0):
    shape = (VOCAB,) if rows is None else (rows, VOCAB)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(logits, p, seed, n=40):
    gen = make_generator(seed)
    return [choose(logits, p, gen) for _ in range(n)]


def test_greedy_is_the_argmax_of_each_row():
    x = _logits(rows=4)
    assert choose_rows(x, SamplingParams(), make_generator(0)).tolist() == x.argmax(-1).tolist()
    assert choose(x[2], SamplingParams(), make_generator(0)) == int(x[2].argmax())


def test_a_seed_repeats_its_draws_and_another_seed_does_not():
    x, p = _logits(), SamplingParams(temperature=1.0)
    a = _draws(x, p, 7)
    assert a == _draws(x, p, 7)
    assert a != _draws(x, p, 8)
    assert len(set(a)) > 3  # sampled, not greedy


def test_top_k_and_top_p_limit_the_choice():
    x = _logits(seed=1)
    top5 = set(torch.topk(x, 5).indices.tolist())
    assert set(_draws(x, SamplingParams(temperature=2.0, top_k=5), 3, n=200)) <= top5
    assert _draws(x, SamplingParams(temperature=2.0, top_k=1), 3) == [int(x.argmax())] * 40
    # a top_p below the likeliest token's probability leaves that token alone
    assert _draws(x, SamplingParams(temperature=1.0, top_p=1e-6), 3) == [int(x.argmax())] * 40


class _Out:
    def __init__(self, logits):
        self.logits = logits


class _FakeEngine:
    """An HF-style forward whose logits depend on the ids it is fed."""
    training = True
    model = torch.nn.Linear(1, 1)  # cache_kwarg reads the forward's signature

    def __init__(self):
        self.seen = []

    def forward(self, ids, use_cache=True, **kw):
        g = torch.Generator().manual_seed(int(ids.sum()) * 31 + ids.shape[1])
        logits = torch.randn(ids.shape[0], ids.shape[1], VOCAB, generator=g) * 3
        self.seen.append(logits[:, -1, :].clone())
        return _Out(logits)


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.8, 1.0), (1.2, 0.9)])
def test_generate_ids_draws_what_the_batchers_choose_draws(temperature, top_p):
    eng = _FakeEngine()
    ids = torch.tensor([[5, 9, 17]])
    out = generate_ids(eng, ids, 10, temperature, top_p, seed=11)[0, 3:].tolist()
    assert len(out) == 10 and eng.training  # restored after generating
    p, gen = SamplingParams(temperature=temperature, top_p=top_p), make_generator(11)
    assert out == [choose(step[0], p, gen) for step in eng.seen]
    if temperature:
        assert out != [int(step[0].argmax()) for step in eng.seen]  # the sampled path, not greedy
