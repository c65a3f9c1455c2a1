"""Activation swapping: saved tensors of chosen layers leave the compute memory during forward and
come back, prefetched in reverse layer order, before that layer's backward.

Two tiers below the compute memory:
- "host": a bounded pool of host buffers (pinned when a GPU computes). On a CPU-only machine the
  compute memory *is* host memory, so this tier only exercises the copy scheduling;
- "nvme": the same staging buffers, then the NVMe store (direct I/O, checksummed); the buffer is
  released when its write lands, so RAM holds only what is in flight.

A tensor is swapped by its storage: autograd often saves several views of one tensor (a linear's
input is saved by q, k and v), so each storage is copied once and every view is rebuilt from it.
Tensors smaller than `min_bytes` stay where they are (a few KiB of norm statistics are not worth
an I/O). The values come back bit for bit, so gradients do not depend on the policy.

With a GPU the copies run on a side stream (engine/copy_stream.py) and overlap compute: out to the
pinned pool as each tensor is saved, the buffer filled (and written on to NVMe) only after the
copy's event; back to the GPU one layer ahead of its backward, which waits on that copy's event.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import Future

import torch

from ..storage import HostBufferPool, TensorStore
from ..storage.aligned import aligned_empty
from .copy_stream import DONE, CopyStream


class _Stored:
    """One swapped storage: its bytes in a host buffer, on the NVMe store, or both."""

    __slots__ = ("key", "nbytes", "buf", "write", "read", "tier", "block", "hold", "dev", "copied", "up",
                 "waited", "device")

    def __init__(self, key: str, nbytes: int, tier: str, block: int):
        self.key, self.nbytes, self.tier, self.block = key, nbytes, tier, block
        self.buf = None
        self.dev = None  # the copy back on the GPU, shared by every view unpacked from it
        self.copied = DONE  # the event of the copy into `buf` (it is filled once that is done)
        self.up = None  # the event of the copy back to `dev`
        self.waited = False  # the compute stream waits on `up` (once for every view)
        self.device = None  # where the storage was computed, and goes back to
        self.hold = False  # backward wants it before its write landed: keep the buffer
        self.write: Future | None = None
        self.read: Future | None = None


class _Owned:
    """An aligned buffer outside the pool (same interface as a pool Buffer)."""

    __slots__ = ("tensor",)

    def __init__(self, nbytes: int):
        self.tensor = aligned_empty(nbytes)

    def release(self) -> None:
        self.tensor = None


class Handle:
    """What autograd keeps in place of a saved tensor: where its storage went and its view."""

    __slots__ = ("stored", "dtype", "size", "stride", "offset", "device")

    def __init__(self, stored: _Stored, t: torch.Tensor):
        self.stored = stored
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.device = t.device


class ActivationSwapper:
    min_bytes = 256 << 10

    def __init__(self, pool: HostBufferPool, store: TensorStore | None, on_event=None,
                 stream: CopyStream | None = None):
        self.pool, self.store, self.on_event = pool, store, on_event
        self.stream = stream or CopyStream()
        self._blocks: dict[int, list[_Stored]] = defaultdict(list)
        self._by_storage: dict[tuple, _Stored] = {}
        self._block = None
        self._tier = None
        self._micro = 0
        self._lock = threading.Lock()
        self.bytes_out = {"host": 0, "nvme": 0}  # swapped this step, per tier (measured)
        self._spent: dict[int, float] = defaultdict(float)  # compute-thread time in copies and waits
        self._spent_total = 0.0
        self._inflight: list[Future] = []

    # ---- forward -----------------------------------------------------------------------
    def begin_forward(self, block: int, tier: str) -> None:
        self._block, self._tier = block, tier
        self._inflight = [f for f in self._inflight if not f.done()]  # landed: nothing to wait for
        self._by_storage = {}
        for s in self._blocks.pop(block, []):  # left from a forward without backward
            self._drop(s)
        self.stream.report(self.on_event)

    def end_forward(self) -> None:
        # A copy out holds the device storage it reads until its event is seen done (copy_stream's
        # _CudaEvent); a host-tier copy's was otherwise first looked at in its layer's backward, so
        # every swap-host layer's activations stayed in GPU memory through the forward. The engine
        # synchronises the device as a layer's forward ends: here its copies have landed.
        for s in self._blocks.get(self._block, []):
            s.copied.done()
        self._block = self._tier = None
        self._by_storage = {}

    @property
    def active(self) -> bool:
        return self._block is not None

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes or t.device.type == "meta":
            return t
        ident = (storage.data_ptr(), nbytes)
        hit = self._by_storage.get(ident)
        if hit is None:
            s = self._swap_out(storage, nbytes)
            if s is None:
                return t  # the host tier is full: it stays in compute memory
            # The storage object is held until the block's forward ends, so its address is not
            # reused by a later temporary of the same size (which would alias this copy).
            self._by_storage[ident] = (s, storage)
        else:
            s = hit[0]
        return Handle(s, t)

    def _swap_out(self, storage, nbytes: int) -> _Stored:
        blk = self._block
        s = _Stored(f"b{blk}/{len(self._blocks[blk])}", nbytes, self._tier, blk)
        self._blocks[blk].append(s)
        s.device = storage.device
        t0 = time.perf_counter()
        src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        s.buf = self._staging(nbytes, s.tier)
        if s.buf is None and s.tier == "host":
            s.tier = "nvme"  # the host pool is full: this one goes down a tier
            s.buf = self._staging(nbytes, s.tier)
        if s.buf is not None:
            s.copied = self.stream.d2h(src, s.buf.tensor[:nbytes], s.key)
        t1 = time.perf_counter()
        self._spent[blk] += t1 - t0
        if self.on_event and self.stream.synchronous:  # a side stream's copies are timed on it
            self.on_event("act_copy", s.key, t0, t1, nbytes)
        self.bytes_out[s.tier] += nbytes
        if s.tier == "nvme":
            if s.buf is None:
                # No staging room and nothing in flight to wait for: write from the tensor itself
                # (the write holds it until it lands).
                s.write = self.store.write(s.key, src if src.device.type == "cpu" else src.cpu())
                self._inflight.append(s.write)
                return s
            # written once the copy has filled the buffer (at once without a GPU)
            filled = s.buf.tensor[:nbytes]
            s.write = self.stream.then(s.copied, s.key, lambda: self.store.write(s.key, filled))
            self._inflight.append(s.write)
            buf = s.buf
            s.write.add_done_callback(lambda f, s=s, buf=buf: self._written(s, buf))
        return s

    def _staging(self, nbytes: int, tier: str):
        """A pool buffer; for NVMe, waiting on the writes in flight while the pool is full."""
        while True:
            # Waiting on the writes in flight (even for a storage larger than the pool, which
            # then goes straight from its tensor) is what bounds the memory they hold.
            buf = self.pool.try_acquire(nbytes) if nbytes <= self.pool.capacity else None
            if buf is not None or tier == "host":
                return buf
            self._inflight = [f for f in self._inflight if not f.done()]
            if not self._inflight:
                return None
            self._inflight[0].exception()  # the oldest lands, its buffer comes back

    def _written(self, s: _Stored, buf) -> None:
        # Whoever takes the buffer out of `s.buf` releases it (here, or _drop), never both.
        with self._lock:
            if s.hold or s.buf is not buf:
                return
            s.buf = None
        self.stream.note("release", s.key)
        buf.release()

    # ---- backward ----------------------------------------------------------------------
    def prefetch(self, block: int) -> None:
        """Start reading `block`'s swapped storages back (called a block or two ahead)."""
        for s in self._blocks.get(block, []):
            self._start_read(s, blocking=False)

    def upload(self, block: int) -> None:
        """Start copying `block`'s storages back to the GPU on the side stream (called when the
        backward of the layer above starts, one layer ahead), those whose bytes are in RAM."""
        if not self.stream.to_device:
            return
        for s in self._blocks.get(block, []):
            if s.dev is None and self._in_ram(s):
                self._copy_up(s)

    def _in_ram(self, s: _Stored) -> bool:
        if s.tier != "nvme" or s.hold:
            return s.buf is not None  # the copy out is ahead of this one on the same stream
        return s.read is not None and s.read.done() and s.read.exception() is None

    def _copy_up(self, s: _Stored) -> None:
        s.dev, s.up = self.stream.h2d(s.buf.tensor[:s.nbytes], s.device, s.key)
        s.waited = False

    def _start_read(self, s: _Stored, blocking: bool) -> bool:
        if s.tier != "nvme" or s.read is not None:
            return True
        with self._lock:
            if s.buf is not None:
                s.hold = True  # still in RAM (its write has not finished): no read needed
                return True
        if s.write is not None:
            s.write.result()  # a failed write raises here, naming its file
        buf = self.pool.try_acquire(s.nbytes) if s.nbytes <= self.pool.capacity else None
        if buf is None:
            if not blocking:
                return False
            # Needed now and the pool holds read-ahead of earlier layers: this layer's activations
            # are the working set the budget's compute share already counts.
            buf = _Owned(s.nbytes)
        s.buf = buf
        s.read = self.store.read_into(s.key, buf.tensor[:s.nbytes], owns_padding=True)
        return True

    def unpack(self, h: Handle) -> torch.Tensor:
        s = h.stored
        t0 = time.perf_counter()
        self._start_read(s, blocking=True)
        if s.read is not None:
            s.read.result()
        t1 = time.perf_counter()
        self._spent[s.block] += t1 - t0
        if self.on_event and t1 - t0 > 1e-4:
            self.on_event("wait", f"activations {s.key}", t0, t1)
        buf = s.buf
        if buf is None:
            raise RuntimeError(f"activation {s.key} was needed again after its block's backward")
        if self.stream.to_device:
            t2 = time.perf_counter()
            if s.dev is None:
                self._copy_up(s)  # not prefetched: its read landed late
            if not s.waited:
                self.stream.wait(s.up, s.dev, s.key)  # the compute stream waits, not the host
                s.waited = True
            t3 = time.perf_counter()
            # issuing the copy and the wait, not the layer's backward: the planner prices the copy apart
            self._spent[s.block] += t3 - t2
            base = s.dev.view(h.dtype)
        else:
            base = buf.tensor[:s.nbytes].view(h.dtype)  # an aligned buffer starts inside its storage
        return base.as_strided(h.size, h.stride, base.storage_offset() + h.offset)

    def end_backward(self, block: int) -> None:
        """The block's graph is consumed: its storages' buffers go back to the pool."""
        for s in self._blocks.pop(block, []):
            self._drop(s)
        self.stream.report(self.on_event)

    def _drop(self, s: _Stored) -> None:
        if s.read is not None:
            s.read.exception()
        if s.write is not None:
            s.write.exception()
        # the host buffer goes back only once the copies that write or read it are done
        if s.buf is not None:
            self.stream.filled(s.copied, s.key)
            if s.up is not None:
                s.up.synchronize()
        s.dev = s.up = None
        with self._lock:
            buf, s.buf = s.buf, None
            s.hold = False
        if buf is not None:
            self.stream.note("release", s.key)
            buf.release()

    def take_spent(self, block: int) -> float:
        """Compute-thread seconds this block spent copying or waiting for its activations."""
        s = self._spent.pop(block, 0.0)
        self._spent_total += s
        return s

    def spent_total(self) -> float:
        return self._spent_total + sum(self._spent.values())

    def reset_stats(self) -> None:
        self.bytes_out = {"host": 0, "nvme": 0}
        self._spent.clear()
        self._spent_total = 0.0

    def close(self) -> None:
        for blk in list(self._blocks):
            self.end_backward(blk)
        self.stream.close()
