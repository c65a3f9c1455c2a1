"""The bounded pool of reusable host buffers: the part of the `cpu` budget that holds tensors.

Every byte the engine streams (weights, optimizer states, gradients) lands in a buffer from this pool,
so its capacity is a hard ceiling, not an estimate. Buffers are reused by size (the layers of a model
have the same shapes) because a fresh large allocation costs a page fault per 4 KiB, which at
gigabytes per step is as slow as the copy itself.
"""
from __future__ import annotations

import threading
from collections import defaultdict

import torch

from ..units import fmt_bytes
from .aligned import aligned_empty, round_up


class BudgetError(RuntimeError):
    """A memory budget cannot hold what is asked of it."""


class Buffer:
    """One aligned host buffer; `tensor` is its uint8 view. Give it back with `release()`."""

    __slots__ = ("tensor", "nbytes", "_pool", "_live")

    def __init__(self, tensor: torch.Tensor, pool: "HostBufferPool"):
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self._pool = pool
        self._live = True

    def view(self, dtype: torch.dtype, shape) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return self.tensor[:nbytes].view(dtype).view(tuple(shape))

    def release(self) -> None:
        if self._live:
            self._live = False
            self._pool._give_back(self)


class HostBufferPool:
    def __init__(self, capacity_bytes: int, pin: bool = False, name: str = "host buffer pool"):
        self.capacity = int(capacity_bytes)
        self.pin = pin
        self.name = name
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._free_bytes = 0
        self._used = 0
        self.peak_used = 0
        self._cv = threading.Condition()

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def resident_bytes(self) -> int:
        """Bytes the pool holds from the OS: handed out plus kept for reuse."""
        return self._used + self._free_bytes

    def acquire(self, nbytes: int, timeout: float | None = None) -> Buffer:
        """A buffer of at least `nbytes`, waiting while the pool is full."""
        size = round_up(max(int(nbytes), 1))
        if size > self.capacity:
            raise BudgetError(
                f"{self.name}: one buffer of {fmt_bytes(size)} is larger than the whole pool "
                f"({fmt_bytes(self.capacity)}); raise --cpu-mem")
        with self._cv:
            while (t := self._reserve(size)) is False:
                if not self._cv.wait(timeout):
                    raise BudgetError(
                        f"{self.name}: timed out waiting for {fmt_bytes(size)} "
                        f"({fmt_bytes(self._used)} of {fmt_bytes(self.capacity)} in use)")
        return self._buffer(t, size)

    def try_acquire(self, nbytes: int) -> Buffer | None:
        """Like acquire, but None instead of waiting when the pool is full (for look-ahead)."""
        size = round_up(max(int(nbytes), 1))
        with self._cv:
            t = self._reserve(size)
        return None if t is False else self._buffer(t, size)

    def _reserve(self, size: int):
        """Under the lock: a cached buffer of this size, None (room to allocate one), or False (full)."""
        free = self._free.get(size)
        if free:
            t = free.pop()
            self._free_bytes -= size
        elif self._used + size <= self.capacity:
            self._evict_until(self.capacity - self._used - size)
            t = None
        else:
            return False
        self._used += size
        self.peak_used = max(self.peak_used, self._used)
        return t

    def _buffer(self, t, size: int) -> Buffer:
        if t is None:
            # Allocate outside the lock: first-touching gigabytes takes a while.
            try:
                t = aligned_empty(size, pin=self.pin)
            except Exception:
                with self._cv:
                    self._used -= size
                    self._cv.notify_all()
                raise
        return Buffer(t, self)

    def _evict_until(self, room: int) -> None:
        """Drop cached free buffers (largest first) until they fit in `room` bytes."""
        for sz in sorted(self._free, reverse=True):
            lst = self._free[sz]
            while lst and self._free_bytes > room:
                lst.pop()
                self._free_bytes -= sz
        for sz in [s for s, lst in self._free.items() if not lst]:
            del self._free[sz]

    def _give_back(self, buf: Buffer) -> None:
        with self._cv:
            self._used -= buf.nbytes
            self._free[buf.nbytes].append(buf.tensor)
            self._free_bytes += buf.nbytes
            self._evict_until(self.capacity - self._used)
            self._cv.notify_all()

    def trim(self) -> None:
        """Return every cached free buffer to the OS."""
        with self._cv:
            self._evict_until(0)
