"""The gradients backward has handed over and the optimizer's thread has not yet consumed.

Backward waits while more than `max_pending` bytes of them wait (the budget's share for
gradients): the optimizer, or its I/O, is then behind the compute, and the time it waits is kept
(blocked_s) and shown on the timeline."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch


class GradQueue:
    def __init__(self, max_pending: int, on_event: Callable | None = None):
        self.max_pending = max_pending
        self.on_event = on_event
        self.grads: dict[str, torch.Tensor] = {}
        self._counted: dict[str, int] = {}  # arrival -> the bytes of it counted as pending
        self._pending = 0
        self._taken: set[str] = set()
        self._closing = False
        self._cv = threading.Condition()
        self.blocked_s = 0.0  # time backward waited in put for the optimizer to catch up

    def put(self, name: str, grad: torch.Tensor, size: int, run: Future | None) -> None:
        """Hand `grad` over as `name`, counted as `size` bytes, once they fit; `run`: the
        optimizer's pass consuming them (a failed one raises its error here, in backward)."""
        t0 = time.perf_counter()
        with self._cv:
            while (self._pending > 0 and self._pending + size > self.max_pending
                   and run is not None and not run.done()):
                self._cv.wait(0.5)
            t1 = time.perf_counter()
            if t1 - t0 > 1e-4:
                # backward stood still: the optimizer (or its I/O) is behind, not the compute
                self.blocked_s += t1 - t0
                if self.on_event:
                    self.on_event("wait", "gradients in flight", t0, t1, 0)
            if run is not None and run.done():
                run.result()  # the worker failed: surface its error in backward
            self.grads[name] = grad
            self._counted[name] = size
            self._pending += size
            self._cv.notify_all()

    def next(self) -> str | None:
        """The next arrival not yet taken, waiting for one; None once closing and none is left."""
        with self._cv:
            while True:
                for name in self.grads:
                    if name not in self._taken:
                        self._taken.add(name)
                        return name
                if self._closing:
                    return None
                self._cv.wait(0.5)

    def done_with(self, name: str) -> None:
        with self._cv:
            if self.grads.get(name) is not None:
                # Keep the tensor until its writes finish (they hold a reference); only the
                # accounting of what backward may produce ahead of us is released here.
                self._pending -= self._counted.pop(name, 0)
                del self.grads[name]
            self._cv.notify_all()

    def open(self) -> None:
        """A new pass: every gradient handed over from now on is to be taken."""
        self._taken = set()

    def close(self) -> None:
        """No more gradients this pass: `next` returns None once the rest are taken."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()

    def clear(self) -> None:
        """After the pass: what was not consumed (parameters unused in the forward) is dropped."""
        with self._cv:
            self._closing = False
            self.grads.clear()
            self._counted.clear()
            self._pending = 0
