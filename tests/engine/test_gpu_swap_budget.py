"""What the activation swap path holds in GPU memory, against what `plan.budget.plan_gpu` reserves
for activations, run on the CPU (issue 45).

The swapper copies through a stream that behaves as CudaCopyStream does on a GPU: copies run in
order only when something waits on them or the device is synchronised (the engine synchronises it
as each layer's forward and backward ends), and a copy out holds the storage it reads until its
event is seen done, through copy_stream's own _CudaEvent. At each layer's forward end and backward
(before the engine synchronises) the test adds up what is on the "device":
- measured, from the swapper: sources of copies out still held, and storages copied back;
- measured, from the engine's saved-tensor count: each kept layer's activations, from its forward
  until its backward ends, and a recomputed layer's while it computes;
- the gradients a layer's backward makes through its activations, taken as one layer's worth (the
  swapper cannot see them; the CPU split counts them so too);
and checks it against the kept layers' allowance plus what plan_gpu sets aside beside it, with the
largest layer's measured activations as plan_gpu's layer_act.
"""
import pytest

from tierlm.engine import act_engine as AE
from tierlm.engine.activations import ActivationSwapper
from tierlm.engine.copy_stream import _CudaEvent
from tierlm.plan import budget as B

from .test_exactness import batches, run_engine
from .test_swap_overlap import DeferredStream

HP = dict(lr=1e-3, wd=0.01, clip=0.5, accum=2, warmup=1, precision="fp32")


class _Ev:
    """What _CudaEvent asks of a torch.cuda.Event, over a deferred copy."""

    def __init__(self, ev):
        self.ev = ev

    def query(self) -> bool:
        return self.ev.ran

    def synchronize(self) -> None:
        self.ev.synchronize()


class CudaLikeStream(DeferredStream):
    """Copies out hold their source until seen done (CudaCopyStream.d2h); `sync` is the device's."""

    def d2h(self, src, dst, key):
        return _CudaEvent(_Ev(super().d2h(src, dst, key)), src)

    def sync(self) -> None:
        with self._lock:
            if self._queue:
                self.run_to(self._queue[-1][3])


def swap_bytes(swapper: ActivationSwapper) -> int:
    """Device bytes the swap path holds: sources of copies out not yet seen done, copies back."""
    held = 0
    for stored in swapper._blocks.values():
        for s in stored:
            held += s.nbytes * ((getattr(s.copied, "src", None) is not None) + (s.dev is not None))
    return held


@pytest.fixture
def record(monkeypatch):
    """Every swapper copies through one CudaLikeStream; the planner's layer hooks note, at each
    layer's forward end and backward, (phase, block, policy, swap-path bytes, kept layers), and the
    activation bytes each layer saved (forward, or a recompute's in backward)."""
    monkeypatch.setattr(ActivationSwapper, "min_bytes", 0)  # the tiny model's tensors all swap
    stream = CudaLikeStream()
    monkeypatch.setattr(AE, "make_copy_stream", lambda device: stream)
    P = AE.ActivationPlanner
    fb, fe, be = P.forward_begin, P.forward_end, P.backward_end
    notes, saved, kept = [], {}, set()

    def note(self, phase, blk):
        pol = self.cur[blk.index]["pol"]
        notes.append((phase, blk.index, pol, swap_bytes(self.swapper), frozenset(kept)))

    def forward_begin(self, blk):
        fb(self, blk)
        if self.cur[blk.index].get("pol") == "keep":
            kept.add(blk.index)

    def forward_end(self, blk, dt, n):
        if "pol" in self.cur[blk.index]:
            note(self, "fwd", blk)
            saved[blk.index] = max(saved.get(blk.index, 0), n)
        stream.sync()  # block_forward_end synchronises the device before this hook
        fe(self, blk, dt, n)

    def backward_end(self, blk, dt, n):
        saved[blk.index] = max(saved.get(blk.index, 0), n)
        note(self, "bwd", blk)
        stream.sync()
        be(self, blk, dt, n)
        kept.discard(blk.index)
    monkeypatch.setattr(P, "forward_begin", forward_begin)
    monkeypatch.setattr(P, "forward_end", forward_end)
    monkeypatch.setattr(P, "backward_end", backward_end)
    return notes, saved


def reserved_beside_kept(layer_act: int, n_layers: int) -> int:
    """What plan_gpu sets aside for activations beyond its allowance for kept ones: how much less
    it leaves when each layer's activations are `layer_act` bytes than when they are none."""
    big = 1 << 50
    return B.plan_gpu(big, 0, 0, 0, 0, n_layers, 0, 0) - B.plan_gpu(big, 0, 0, layer_act, 0, n_layers, 0, 0)


def device_activations(note, saved: dict, layer_act: int) -> int:
    phase, blk, pol, swapped, kept = note
    on = swapped + sum(saved[k] for k in kept)
    if pol == "recompute":
        on += saved[blk]  # its forward makes them and drops them; its backward makes them again
    if phase == "bwd":
        on += layer_act  # the gradients its backward makes through them
    return on


@pytest.mark.parametrize("activations", ["swap-host", "swap", "keep,swap-host,recompute",
                                         "swap-host,swap-host,recompute"])
def test_the_swap_path_stays_inside_what_plan_gpu_reserves(make_model_dir, tmp_path, record, activations):
    notes, saved = record
    model_dir, _ = make_model_dir("llama")
    run_engine(model_dir, tmp_path, batches(4, seq=16), activations=activations, **HP)
    layers = sorted(saved)
    layer_act = max(saved.values())
    assert len(layers) == 3 and min(saved.values()) > 0
    pols = dict(zip(layers, (activations.split(",") * 3)[:3]))
    # the swap path alone: the layer computing's swapped storages and the next one's copied back
    worst = max(notes, key=lambda n: n[3])
    assert worst[3] <= 2 * layer_act, f"{worst[3]} bytes swapped held at {worst[:3]}, a layer is {layer_act}"
    allowance = sum(saved[b] for b, p in pols.items() if p == "keep")
    share = allowance + reserved_beside_kept(layer_act, len(layers))
    worst = max(notes, key=lambda n: device_activations(n, saved, layer_act))
    got = device_activations(worst, saved, layer_act)
    assert got <= share, f"{got} bytes of activations on the device at {worst[:3]}, {share} reserved"
    pairs = {b for b in layers if pols[b] == "swap-host" and pols.get(b - 1) == "swap-host"}
    if pairs:  # the copy back one layer ahead ran: two layers' swapped storages on the device at once
        assert any(ph == "bwd" and b in pairs and sw > saved[b] for ph, b, _, sw, _ in notes)


def test_the_check_catches_a_swap_path_that_holds_a_layer_too_many():
    # three layers of 100 bytes: the layer computing's and the next one's copies back, one too many
    notes = [("bwd", 3, "swap-host", 300, frozenset())]
    saved = {1: 100, 2: 100, 3: 100}
    assert device_activations(notes[0], saved, 100) > reserved_beside_kept(100, 3)
