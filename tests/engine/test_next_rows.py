"""The next forward's embedding rows, copied out of the step's update (tierlm.engine.next_rows):
that forward reads no embedding, and the weights are the same bits as when it reads it."""
import threading
import time

import pytest
import torch

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig

from .test_exactness import batches


def _train(model_dir, tmp_path, data, tag, expect, clip=None, nan_step=None, accum=1, precision="fp32",
           expect_ids=None, clip_path="speculate", patch=None):
    cfg = EngineConfig(nvme_dir=str(tmp_path / f"nv-{tag}"), cpu_mem="1GiB", precision=precision, grad_accum=accum,
                       tokens_per_micro_batch=data[0].numel(), shard_elems=2048, clip_path=clip_path,
                       optim=AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=clip))
    eng = Engine.from_pretrained(model_dir, cfg)
    if patch is not None:
        patch(eng)
    embed_reads = []  # the embedding's loads into the modules (a window hit or a read)
    real_acquire = eng.window.acquire
    eng.window.acquire = lambda ns: (embed_reads.extend(n for n in ns if "embed_tokens" in n)
                                     or real_acquire(ns))
    losses = []
    try:
        steps = len(data) // accum
        for s in range(steps):
            for i, x in enumerate(data[s * accum:(s + 1) * accum]):
                n0 = len(embed_reads)
                loss = eng.forward(x, labels=x).loss
                if i == 0:
                    losses.append((loss.item(), len(embed_reads) - n0))
                if s == nan_step:
                    loss = loss * float("nan")
                if expect and i == accum - 1 and s + 1 < steps:
                    eng.expect(expect_ids if expect_ids is not None else data[(s + 1) * accum])
                eng.backward(loss)
            eng.step()
        masters = {n: eng.master(n) for n in eng.names}
        weights = {n: eng.weights(n) for n in eng.names}
        used = eng.next_rows.used if eng.next_rows is not None else None
    finally:
        eng.close()
    return masters, weights, losses, used


@pytest.mark.parametrize("arch", ["llama", "qwen2"], ids=["untied", "tied"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip-triggers"])
def test_the_next_lookup_takes_its_rows_from_the_update_with_the_same_bits(make_model_dir, tmp_path, arch, clip):
    """Four steps: from the second on, the forward's lookup loads nothing of the embedding (a tied
    head still does), and masters, working weights and losses are those of the run that loads it
    every time. With a clip redo the rows are the redone ones. Taking the rows before the update
    (in expect) fails it (checked)."""
    model_dir, _ = make_model_dir(arch)
    data = batches(4)
    ref_m, ref_w, ref_l, _ = _train(model_dir, tmp_path, data, "ref", expect=False, clip=clip)
    got_m, got_w, got_l, used = _train(model_dir, tmp_path, data, "rows", expect=True, clip=clip)
    assert used == 3
    assert [lo for lo, _ in got_l] == [lo for lo, _ in ref_l]
    per_forward = 1 if arch == "llama" else 2  # the lookup's load, and the tied head's
    assert [r for _, r in ref_l] == [per_forward] * 4
    assert [r for _, r in got_l] == [per_forward] + [per_forward - 1] * 3
    for n in ref_m:
        assert torch.equal(got_m[n], ref_m[n]), n
        assert torch.equal(got_w[n], ref_w[n]), n


def test_bf16_gradient_accumulation_takes_the_rows_too(make_model_dir, tmp_path):
    model_dir, _ = make_model_dir("llama")
    data = batches(6)
    ref_m, ref_w, ref_l, _ = _train(model_dir, tmp_path, data, "ref", expect=False, accum=2, precision="bf16")
    got_m, got_w, got_l, used = _train(model_dir, tmp_path, data, "rows", expect=True, accum=2, precision="bf16")
    assert used == 2 and [r for _, r in got_l] == [1, 0, 0]
    assert [lo for lo, _ in got_l] == [lo for lo, _ in ref_l]
    for n in ref_m:
        assert torch.equal(got_m[n], ref_m[n]), n
        assert torch.equal(got_w[n], ref_w[n]), n


def test_other_ids_or_a_dropped_step_read_the_embedding(make_model_dir, tmp_path):
    """Rows expected for other ids are not used; nor are a non-finite (dropped) step's: the old
    weights stay, and the forward after it loads them."""
    model_dir, _ = make_model_dir("llama")
    data = batches(3)
    ref_m, _, ref_l, _ = _train(model_dir, tmp_path, data, "ref", expect=False, nan_step=1)
    got_m, _, got_l, used = _train(model_dir, tmp_path, data, "nan", expect=True, nan_step=1)
    assert used == 1  # step 2's forward (after the finite step 1); step 3's follows the dropped step
    assert [r for _, r in got_l] == [1, 0, 1] and [lo for lo, _ in got_l] == [lo for lo, _ in ref_l]
    for n in ref_m:
        assert torch.equal(got_m[n], ref_m[n]), n
    _, _, _, used = _train(model_dir, tmp_path, data, "other", expect=True, expect_ids=data[0].flip(0))
    assert used == 0


def test_a_tied_lookups_gradient_goes_into_the_heads_without_a_weight_sized_tensor(make_model_dir, tmp_path,
                                                                                   monkeypatch):
    """With a tied head, the rows' gradient sums are added into the head's gradient in place
    (TiedHeadGrad.add_rows): each lookup from the update goes that way, and the result is the bits
    of the dense route (the test above compares the weights with the run that reads the embedding)."""
    from tierlm.engine.tied import TiedHeadGrad
    model_dir, _ = make_model_dir("qwen2")
    data = batches(3)
    calls = []
    real = TiedHeadGrad.add_rows
    monkeypatch.setattr(TiedHeadGrad, "add_rows", lambda self, rows, sums: calls.append(sums.shape) or real(self, rows, sums))
    ref_m, _, ref_l, _ = _train(model_dir, tmp_path, data, "ref", expect=False)
    assert not calls
    got_m, _, got_l, used = _train(model_dir, tmp_path, data, "rows", expect=True)
    assert used == 2 and len(calls) == 2
    assert all(s[0] == len(torch.unique(x)) for s, x in zip(calls, data[1:]))  # the distinct rows only
    assert [lo for lo, _ in got_l] == [lo for lo, _ in ref_l]
    for n, t in ref_m.items():
        assert torch.equal(got_m[n], t), n


def test_backward_does_not_read_ahead_an_embedding_whose_rows_are_expected(make_model_dir, tmp_path, monkeypatch):
    """Backward's read-ahead past layer 0 is for the next forward's embedding block: with its rows
    expected, that forward reads none of it, so neither does the read-ahead (for Qwen2.5-0.5B,
    272 MB a step that nothing used)."""
    from tierlm.engine.weights import WeightWindow
    model_dir, _ = make_model_dir("llama")
    events = []
    for cls, name in ((WeightWindow, "prefetch"), (Engine, "expect"), (Engine, "commit")):
        real = getattr(cls, name)
        tag = "embed" if name == "prefetch" else name

        def wrap(self, *a, real=real, tag=tag):
            if tag != "embed" or any("embed_tokens" in n for n in a[0]):
                events.append(tag)
            return real(self, *a)
        monkeypatch.setattr(cls, name, wrap)
    _, _, _, used = _train(model_dir, tmp_path, batches(4), "rows", expect=True)
    assert used == 3
    between = " ".join(events).split("expect")[1:]
    assert len(between) == 3 and not any("embed" in e.split("commit")[0] for e in between), events


@pytest.mark.parametrize("arch", ["llama", "qwen2"], ids=["untied", "tied"])
@pytest.mark.parametrize("clip", [0.5, 1e9], ids=["clip-triggers", "clip-idle"])
def test_a_held_update_beside_the_next_forward_hands_it_the_rows(make_model_dir, tmp_path, arch, clip):
    """Exact clipping that holds the gradients runs each update after its commit, beside the next
    forward: the lookup waits for the embedding's shards as that update offers them (slowed down
    here, so that it does wait) instead of reading the embedding back, with the same bits."""
    from tierlm.engine.next_rows import NextRows
    model_dir, _ = make_model_dir(arch)
    data = batches(4)
    waited = []

    def slow_offers(eng):
        nr, real = eng.next_rows, eng.next_rows.offer

        def offer(shard, values):
            if nr.waits():
                time.sleep(0.02)
            real(shard, values)
        nr.offer = offer
        real_take = nr.take
        nr.take = lambda ids: (waited.append(nr.waits()), real_take(ids))[1]
        assert isinstance(nr, NextRows) and eng.optimizer.defer_apply
    ref_m, ref_w, ref_l, _ = _train(model_dir, tmp_path, data, "ref", expect=False, clip=clip, clip_path="hold")
    got_m, got_w, got_l, used = _train(model_dir, tmp_path, data, "rows", expect=True, clip=clip,
                                       clip_path="hold", patch=slow_offers)
    assert used == 3 and waited[1:] == [True] * 3
    assert [lo for lo, _ in got_l] == [lo for lo, _ in ref_l]
    per_forward = 1 if arch == "llama" else 2
    assert [r for _, r in got_l] == [per_forward] + [per_forward - 1] * 3
    for n in ref_m:
        assert torch.equal(got_m[n], ref_m[n]), n
        assert torch.equal(got_w[n], ref_w[n]), n


def test_a_held_update_that_fails_fails_the_lookup_waiting_for_it(make_model_dir, tmp_path):
    """The deferred update stops halfway through the embedding's shards: the next forward, waiting
    for the rest of its rows, raises the update's error instead of waiting for ever."""
    model_dir, _ = make_model_dir("llama")
    data = batches(3)

    def break_offers(eng):
        nr, real = eng.next_rows, eng.next_rows.offer
        seen = []

        def offer(shard, values):
            if nr.waits():
                seen.append(shard)
                if len(seen) == 2:
                    raise OSError(5, "injected: the update's write failed")
            real(shard, values)
        nr.offer = offer
    out = {}

    def run():
        try:
            _train(model_dir, tmp_path, data, "fail", expect=True, clip=0.5, clip_path="hold", patch=break_offers)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the forward waited for rows the failed update never offered"
    assert "injected" in str(out.get("error")), out
