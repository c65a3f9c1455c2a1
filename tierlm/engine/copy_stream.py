"""The copies of swapped activations between compute memory and host memory.

With a GPU they run on a side CUDA stream, so they overlap the layers that compute meanwhile: a
saved tensor goes out to the pinned pool ordered after the compute that produced it (the side
stream waits on the compute stream), and comes back ahead of its layer's backward, which waits on
the copy's event (the GPU waits, not the host). The host buffer counts as filled only once the
copy's event has completed; a device tensor the copy reads stays allocated until then
(record_stream), and one the copy writes is freed only after the compute that uses it.

Without a GPU the compute memory is host memory: a copy is a plain copy, done when issued.

Every stream can record the order of its operations (`log`, a list of (operation, key)): "d2h" and
"h2d" when a copy is issued, "filled" when its event is seen complete, "wait" when compute waits on
it, "release" when the swapper gives the host buffer back; a test checks the schedule from it.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Done:
    """The event of a copy that has already happened."""

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE = Done()


class CopyStream:
    synchronous = True   # copies are done when issued (the swapper times them on the host)
    to_device = False    # backward unpacks from the host buffer itself: no copy back

    def __init__(self):
        self.log: list[tuple[str, str]] | None = None
        self._waiter: ThreadPoolExecutor | None = None

    def note(self, op: str, key: str) -> None:
        if self.log is not None:
            self.log.append((op, key))

    def d2h(self, src: torch.Tensor, dst: torch.Tensor, key: str):
        """Copy `src` (compute memory) into the host buffer `dst`; the event says when it is filled."""
        dst.copy_(src)
        self.note("d2h", key)
        return DONE

    def h2d(self, src: torch.Tensor, device: torch.device, key: str):
        """A compute-memory copy of the host buffer `src`, and the event of that copy."""
        self.note("h2d", key)
        return src.to(device), DONE

    def wait(self, ev, dev: torch.Tensor, key: str) -> None:
        """Compute uses `dev` (from h2d) from now on: it runs after the copy's event."""
        ev.synchronize()
        self.note("wait", key)

    def filled(self, ev, key: str) -> None:
        """Block the host until the copy behind `ev` has landed."""
        ev.synchronize()
        self.note("filled", key)

    def then(self, ev, key: str, start) -> Future:
        """`start()` (which returns a Future: the NVMe write of a filled buffer) once `ev` is
        complete: at once when it is, else from a waiting thread, so compute goes on."""
        if ev.done():
            self.note("filled", key)
            return start()
        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix="tierlm-copy-wait")

        landed = Future()  # the write's own future: several writes may be in flight at once

        def later():
            try:
                self.filled(ev, key)
                write = start()
            except BaseException as e:  # noqa: BLE001  (handed to whoever waits on the write)
                landed.set_exception(e)
                return
            write.add_done_callback(lambda f: landed.set_exception(f.exception()) if f.exception()
                                    else landed.set_result(f.result()))
        self._waiter.submit(later)
        return landed

    def report(self, on_event) -> None:
        """Hand the copies that have completed to the timeline (the host timed synchronous ones)."""

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
            self._waiter = None


class _CudaEvent:
    """A copy's completion on the side stream; holds the tensor it reads until it is seen done."""

    __slots__ = ("ev", "src")

    def __init__(self, ev, src):
        self.ev, self.src = ev, src

    def done(self) -> bool:
        if self.src is not None and self.ev.query():
            self.src = None
        return self.src is None

    def synchronize(self) -> None:
        self.ev.synchronize()
        self.src = None


class CudaCopyStream(CopyStream):
    synchronous = False
    to_device = True

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._timed: list[tuple] = []  # (lane, key, start, end, nbytes) not yet reported
        # the side stream's clock against the host's: copies are drawn on the host's time axis
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record(self.stream)
        self._anchor.synchronize()
        self._anchor_t = time.perf_counter()

    def _copy(self, lane: str, key: str, nbytes: int, fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            out = fn()
            end.record(self.stream)
        self._timed.append((lane, key, start, end, nbytes))
        return out, end

    def d2h(self, src, dst, key):
        # after the compute enqueued so far: the kernels that produced `src`
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        _, end = self._copy("act_copy", key, src.numel(), lambda: dst.copy_(src, non_blocking=True))
        src.record_stream(self.stream)  # not reused by compute before the copy has read it
        self.note("d2h", key)
        return _CudaEvent(end, src)

    def h2d(self, src, device, key):
        dev, end = self._copy("h2d", key, src.numel(), lambda: src.to(device, non_blocking=True))
        self.note("h2d", key)
        return dev, _CudaEvent(end, src)

    def wait(self, ev, dev, key):
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(ev.ev)
        dev.record_stream(cur)  # freed only once the compute stream is past its last use
        self.note("wait", key)

    def report(self, on_event) -> None:
        left = []
        for lane, key, start, end, nbytes in self._timed:
            if not end.query():
                left.append((lane, key, start, end, nbytes))
                continue
            if on_event:
                t0 = self._anchor_t + self._anchor.elapsed_time(start) / 1e3
                on_event(lane, key, t0, t0 + start.elapsed_time(end) / 1e3, nbytes)
        self._timed = left

    def close(self) -> None:
        self.stream.synchronize()
        super().close()


def make_copy_stream(device: torch.device) -> CopyStream:
    return CudaCopyStream(device) if device.type == "cuda" else CopyStream()
