"""A tied head's gradient: taken over from autograd, summed into the embedding's in place, and its
rows the batch does not look up updated at the start of backward (tierlm.engine.tied)."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig

from .test_exactness import batches, run_engine, run_reference

VOCAB, HIDDEN = 4096, 64


@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
@pytest.mark.parametrize("chunk", [0, 5], ids=["hf-head", "chunked-head"])
def test_backward_makes_no_third_tensor_the_tied_weights_size(make_model_dir, tmp_path, chunk, early):
    """The embedding's gradient of qwen2's tied weight is the only tensor of its size a second step's
    backward makes: autograd's out-of-place sum of it and the head's was another, over the budget at
    the step's peak (Qwen2.5-0.5B under --cpu-mem 4GiB), and the unchunked head's own is made into
    a buffer kept from the first step (the chunked head's is made in forward). Leaving the sum to
    autograd fails this, and so does a new buffer for the head's gradient each step (checked)."""
    model_dir, _ = make_model_dir("qwen2", vocab_size=VOCAB, hidden_size=HIDDEN)
    data = batches(2, vocab=VOCAB)
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nv"), cpu_mem="1GiB", precision="fp32", loss_chunk=chunk,
                       tokens_per_micro_batch=data[0].numel(), shard_elems=2048, early_tied=early,
                       optim=AdamWConfig(lr=1e-2, max_grad_norm=None))
    eng = Engine.from_pretrained(model_dir, cfg)
    try:
        eng.backward(eng.forward(data[0], labels=data[0]).loss)  # pools and caches made
        eng.step()
        loss = eng.forward(data[1], labels=data[1]).loss
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            eng.backward(loss)
        eng.step()
        fresh = eng.tied_grad.fresh
    finally:
        eng.close()
    size = VOCAB * HIDDEN * 4
    made = [(e.name, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage >= size]
    assert len(made) == 1, made
    assert fresh == (1 if chunk == 0 else 0)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip-triggers"])
def test_tied_rows_not_looked_up_update_at_the_start_of_backward(make_model_dir, tmp_path, monkeypatch, clip):
    """qwen2's tiny head is its embedding (128 rows of 64, 4 shards of 32 rows). Tokens below 32
    look up rows of shard 0 only: shards 1-3 get the head's gradient alone, final when the head's
    backward ends, and go to the optimizer then; the engine's weights are the same bits as when
    every shard waits for the embedding's backward (and within rounding of torch's, the chunked
    loss summing in another order). With a clip redo too. Handing shard 0 over early as well
    fails it (checked)."""
    from tierlm.engine.optimizer import OutOfCoreAdamW
    model_dir, model = make_model_dir("qwen2")
    data = batches(3, vocab=32)
    kw = dict(lr=1e-2, wd=0.1, clip=clip, accum=1, warmup=1, precision="fp32", loss_chunk=5, shard_elems=2048)
    early = []
    real = OutOfCoreAdamW.grad_ready
    monkeypatch.setattr(OutOfCoreAdamW, "grad_ready", lambda self, n, g, shards=None, **kw:
                        (early.append((n, shards)) if shards is not None else None) or real(self, n, g, shards, **kw))
    masters, _, losses, _ = run_engine(model_dir, tmp_path, data, tag="early", **kw)
    assert early == [("model.embed_tokens.weight", [1, 2, 3])] * 3
    early.clear()
    late_masters, _, late_losses, _ = run_engine(model_dir, tmp_path, data, tag="late", early_tied=False, **kw)
    assert not early  # off: every shard waited for the embedding's gradient
    assert losses == late_losses
    for n, t in late_masters.items():
        assert torch.equal(masters[n], t), n
    _, ref_master, ref_losses, _ = run_reference(model, data, **{k: v for k, v in kw.items()
                                                                 if k not in ("loss_chunk", "shard_elems")})
    for n, t in ref_master.items():
        # k_proj's bias has no gradient but rounding (softmax ignores a shift shared by every key),
        # and Adam scales that noise up to lr-sized steps: the chunked loss's order of summation
        # moves it by ~1.5e-5 of lr 1e-2 after three steps (AVX-512), more than rounding elsewhere
        atol = 1e-4 if n.endswith("k_proj.bias") else 1e-5
        torch.testing.assert_close(masters[n], t, rtol=1e-4, atol=atol, msg=n)


def test_the_unchunked_heads_gradient_is_taken_over_with_the_same_bits(make_model_dir, tmp_path):
    """HF's own head (small logits): the head's gradient goes around autograd and is added to the
    embedding's by the engine; two steps with a clip are the same bits as torch's AdamW on the
    in-memory model, the early rows included (tokens below 32 look up shard 0 of 4 only)."""
    model_dir, model = make_model_dir("qwen2")
    data = batches(2, vocab=32)
    kw = dict(lr=1e-2, wd=0.1, clip=0.5, accum=1, warmup=1, precision="fp32")
    masters, _, losses, _ = run_engine(model_dir, tmp_path, data, shard_elems=2048, **kw)
    _, ref_master, ref_losses, _ = run_reference(model, data, **kw)
    assert losses == ref_losses
    for n, t in ref_master.items():
        assert torch.equal(masters[n], t), n
