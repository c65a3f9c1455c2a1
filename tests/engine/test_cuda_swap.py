"""Activation swapping on the GPU with its copies on a side stream (engine/copy_stream.py): out to
the pinned pool during forward, back one layer ahead of backward, overlapped with compute. A tiny
model fine-tuned with swap-host and swap equals keep bit for bit. Skipped where PyTorch sees no GPU
(tests/engine/test_swap_overlap.py checks the same schedule on the CPU)."""
import pytest
import torch

from tierlm.engine.activations import ActivationSwapper
from tierlm.engine.copy_stream import CudaCopyStream, make_copy_stream
from tierlm.storage.aligned import aligned_empty

from .test_cuda import assert_same, batches, run_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


def test_side_stream_copies_round_trip_and_are_timed():
    stream = make_copy_stream(CUDA)
    assert isinstance(stream, CudaCopyStream)
    stream.log = []
    x = torch.randn(1 << 20, device=CUDA)
    y = x * 3  # computed on the compute stream: the copy out must come after it
    src = y.view(torch.uint8)
    host = aligned_empty(src.numel(), pin=True)[:src.numel()]
    out = stream.d2h(src, host, "k")
    stream.filled(out, "k")
    assert out.done()
    back, ev = stream.h2d(host, CUDA, "k")
    stream.wait(ev, back, "k")
    assert torch.equal(back.view(torch.float32), x * 3)
    events = []
    torch.cuda.synchronize()
    stream.report(lambda lane, key, t0, t1, nbytes: events.append((lane, key, t1 - t0, nbytes)))
    assert [(e[0], e[1], e[3]) for e in events] == [("act_copy", "k", 4 << 20), ("h2d", "k", 4 << 20)]
    assert all(e[2] >= 0 for e in events)
    assert [op for op, _ in stream.log] == ["d2h", "filled", "h2d", "wait"]
    stream.close()


@pytest.mark.parametrize("activations", ["swap-host", "swap", "swap-host,swap,recompute"])
def test_overlapped_swap_equals_keep_bit_for_bit(make_model_dir, tmp_path, monkeypatch, activations):
    monkeypatch.setattr(ActivationSwapper, "min_bytes", 0)  # the tiny model's tensors all swap
    model_dir, _ = make_model_dir("llama")
    data = batches(2)
    kw = dict(lr=1e-2, clip=0.5, accum=1, precision="fp32")
    keep, keep_losses, _ = run_engine(model_dir, tmp_path, data, **kw)
    got, losses, _ = run_engine(model_dir, tmp_path, data, activations=activations, tag="b", **kw)
    assert losses == keep_losses
    assert_same(keep, got)
