"""The GPU's overlapped swap schedule, run on the CPU: the swapper driven through a copy stream that
behaves like a CUDA side stream (a copy happens only when something waits on its event, in the
order the copies were issued, and a buffer copied back is garbage until then), so the engine's
schedule is checked here without a GPU:
- a swapped layer's copies out are issued inside its forward (after the compute that produced
  them, before the next layer's forward);
- layer i-1's copies back are issued before layer i's backward computes (one layer ahead);
- no host buffer goes back to the pool before the copy that fills it, and the copy back that
  reads it, have completed (and an NVMe write starts only from a filled buffer);
- the weights equal torch's bit for bit, as with every other policy.
"""
import re
import threading

import pytest
import torch

from tierlm.engine import act_engine as AE
from tierlm.engine.activations import ActivationSwapper
from tierlm.engine.copy_stream import CopyStream

from .test_exactness import batches, run_engine, run_reference

HP = dict(lr=1e-3, wd=0.01, clip=0.5, accum=2, warmup=1, precision="fp32")


class _Event:
    def __init__(self, stream):
        self.stream, self.ran = stream, False

    def done(self) -> bool:
        return self.ran

    def synchronize(self) -> None:
        self.stream.run_to(self)


class DeferredStream(CopyStream):
    """A side stream on the CPU: copies queue up and run, in order, only when waited on."""
    synchronous = False
    to_device = True

    def __init__(self):
        super().__init__()
        self.log = []
        self._queue = []
        self._lock = threading.RLock()

    def _enqueue(self, op, key, fn):
        ev = _Event(self)
        with self._lock:
            self._queue.append((op, key, fn, ev))
            self.note(op, key)
        return ev

    def run_to(self, ev) -> None:
        with self._lock:
            while not ev.ran:
                op, key, fn, e = self._queue.pop(0)
                fn()
                e.ran = True
                self.note("ran " + op, key)

    def d2h(self, src, dst, key):
        return self._enqueue("d2h", key, lambda: dst.copy_(src))

    def h2d(self, src, device, key):
        dev = torch.full_like(src, 255, device=device)  # NaN until the copy has run
        return dev, self._enqueue("h2d", key, lambda: dev.copy_(src))

    def wait(self, ev, dev, key):
        ev.synchronize()  # the compute "stream" is the host here
        self.note("wait", key)


@pytest.fixture
def deferred(monkeypatch):
    """Every swapper the engine builds copies through one DeferredStream; the planner's layer
    hooks mark the log with where each layer's forward and backward compute."""
    monkeypatch.setattr(ActivationSwapper, "min_bytes", 0)
    stream = DeferredStream()
    monkeypatch.setattr(AE, "make_copy_stream", lambda device: stream)
    P = AE.ActivationPlanner
    fb, fe, bb = P.forward_begin, P.forward_end, P.backward_begin

    def forward_begin(self, blk):
        stream.note("fwd", blk.index)
        fb(self, blk)

    def forward_end(self, blk, dt, saved):
        fe(self, blk, dt, saved)
        stream.note("fwd_end", blk.index)

    def backward_begin(self, blk):
        bb(self, blk)
        stream.note("bwd", blk.index)  # the layer's backward computes from here
    monkeypatch.setattr(P, "forward_begin", forward_begin)
    monkeypatch.setattr(P, "forward_end", forward_end)
    monkeypatch.setattr(P, "backward_begin", backward_begin)
    return stream


def _block(key) -> int:
    return int(re.match(r"b(\d+)/", key).group(1))


def _check_schedule(log, host_blocks):
    in_fwd = None
    out, up = {}, {}           # this forward's storages per block: copied out, copied back
    pending = {}                # key -> copies issued on its buffer and not yet run
    filled = set()
    for op, key in log:
        if op == "fwd":
            in_fwd, out[key], up[key] = key, set(), set()
        elif op == "fwd_end":
            in_fwd = None
        elif op == "d2h":
            assert in_fwd == _block(key), f"{key} copied out outside its layer's forward"
            out[_block(key)].add(key)
            pending.setdefault(key, set()).add("d2h")
            filled.discard(key)
        elif op == "h2d":
            up[_block(key)].add(key)
            pending.setdefault(key, set()).add("h2d")
        elif op.startswith("ran "):
            pending[key].discard(op[4:])
        elif op == "filled":
            assert "d2h" not in pending.get(key, ()), f"{key} taken as filled before its copy ran"
            filled.add(key)
        elif op == "release":
            assert not pending.get(key), f"{key}'s buffer released with {pending[key]} not run"
            assert key in filled, f"{key}'s buffer released without waiting for its copy"
        elif op == "bwd":
            # this layer's storages and, one layer ahead, the next one's are on their way back
            for b in (key, key - 1):
                if b in host_blocks and b in out:
                    assert out[b] <= up[b], f"block {b}: {out[b] - up[b]} not copied back at block {key}'s backward"
        elif op == "wait":
            assert key in up[_block(key)]


@pytest.mark.parametrize("activations", ["swap-host", "swap", "swap-host,recompute,swap"])
def test_side_stream_schedule_keeps_the_bits(make_model_dir, tmp_path, deferred, activations):
    model_dir, model = make_model_dir("llama")
    data = batches(4, seq=16)
    _, ref_masters, ref_losses, _ = run_reference(model, data, **HP)
    masters, _, losses, _ = run_engine(model_dir, tmp_path, data, activations=activations, **HP)
    assert losses == ref_losses
    for n, m in ref_masters.items():
        assert torch.equal(masters[n], m), n
    log = deferred.log
    layer_blocks = sorted({k for op, k in log if op == "fwd"})
    pols = (activations.split(",") * 3)[:3]
    host = {b for b, p in zip(layer_blocks, pols) if p == "swap-host"}
    assert any(op == "d2h" for op, _ in log) and any(op == "wait" for op, _ in log)
    _check_schedule(log, host)
    if host:
        # copies out ran later than they were issued (a swap-host buffer is not waited on until its
        # copy back): the schedule was exercised, not a plain copy
        assert any(op == "d2h" and log[i + 1] != ("ran d2h", k) for i, (op, k) in enumerate(log))
        # one layer ahead: the copies back of a layer below another were checked at its backward
        assert any(op == "bwd" and k - 1 in host for op, k in log)


def test_schedule_check_catches_a_buffer_released_early():
    log = [("fwd", 1), ("d2h", "b1/0"), ("fwd_end", 1), ("release", "b1/0")]
    with pytest.raises(AssertionError, match="released"):
        _check_schedule(log, {1})
    log = [("fwd", 1), ("d2h", "b1/0"), ("fwd_end", 1), ("bwd", 2)]
    with pytest.raises(AssertionError, match="not copied back"):
        _check_schedule(log, {1})


def test_a_write_waits_for_its_copy_and_its_failure_reaches_the_waiter():
    from concurrent.futures import Future
    stream = DeferredStream()
    src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    ev = stream.d2h(src, dst, "k")
    seen = []

    def write():
        seen.append(dst.clone())  # what the write would put on the drive
        f = Future()
        f.set_exception(OSError("disk full"))
        return f
    landed = stream.then(ev, "k", write)
    with pytest.raises(OSError, match="disk full"):
        landed.result(timeout=10)
    assert torch.equal(seen[0], src)  # the write started from the filled buffer
    assert stream.log[:3] == [("d2h", "k"), ("ran d2h", "k"), ("filled", "k")]
    stream.close()
