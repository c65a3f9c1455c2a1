"""The bounded pool of reusable host buffers: the part of the `cpu` budget that holds tensors.

Every byte the engine streams (weights, optimizer states, gradients) lands in a buffer from this pool,
so its capacity is a hard ceiling, not an estimate. Freed buffers are reused because a fresh large
allocation costs a page fault per 4 KiB, which at gigabytes per step is as slow as the copy itself:
by exact size, or (`arena=True`, the engine's window and optimizer pools) by placing every buffer in
one region whose freed ranges serve any later size (arena.py).
"""
from __future__ import annotations

import threading
from collections import defaultdict

import torch

from ..units import fmt_bytes
from .aligned import aligned_empty, round_up
from .arena import Arena


class BudgetError(RuntimeError):
    """A memory budget cannot hold what is asked of it."""


class Buffer:
    """One aligned host buffer; `tensor` is its uint8 view. Give it back with `release()`."""

    __slots__ = ("tensor", "nbytes", "offset", "_pool", "_live")

    def __init__(self, tensor: torch.Tensor, pool: "HostBufferPool", offset: int | None = None):
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.offset = offset  # where it lies in the pool's arena; None: allocated on its own
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
    def __init__(self, capacity_bytes: int, pin: bool = False, name: str = "host buffer pool",
                 arena: bool = False):
        """arena: place buffers in one region of `capacity` bytes whose freed pages serve any later
        size (a pool that streams many sizes through a fixed capacity). Not for pinned pools (the
        region would be locked whole) nor for one whose capacity changes later."""
        self.capacity = int(capacity_bytes)
        self.pin = pin
        self.name = name
        self.arena = Arena(self.capacity) if arena and not pin and self.capacity > 0 else None
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
        return self._used + self._free_bytes + (self.arena.dirty if self.arena else 0)

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

    def try_acquire(self, nbytes: int, avoid: tuple[int, int] | None = None,
                    arena_only: bool = False) -> Buffer | None:
        """Like acquire, but None instead of waiting when the pool is full (for look-ahead).
        avoid: an arena range to keep clear. arena_only: None where the arena has no place for it
        (a caller that can free one rather than take fresh pages)."""
        size = round_up(max(int(nbytes), 1))
        with self._cv:
            t = self._reserve(size, avoid, arena_only and self.arena is not None)
        return None if t is False else self._buffer(t, size)

    def to_free_for(self, nbytes: int, movable: dict[Buffer, float]) -> tuple[list[Buffer], tuple[int, int]] | None:
        """Which of `movable` (buffer -> cost) to release or move so that one buffer of `nbytes`
        fits in the arena: the set whose costliest member costs least, and the arena range it
        spans (for `try_acquire(avoid=)`). None without an arena or where no set would do."""
        if self.arena is None:
            return None
        by_start = {b.offset: b for b in movable if b.offset is not None}
        with self._cv:
            got = self.arena.cheapest_range(
                round_up(max(int(nbytes), 1)), {a: (a + b.nbytes, movable[b]) for a, b in by_start.items()})
        return None if got is None else ([by_start[a] for a in got[0]], got[1])

    def _reserve(self, size: int, avoid: tuple[int, int] | None = None, arena_only: bool = False):
        """Under the lock: (tensor, arena offset or None) for a place in the arena or a cached buffer
        of this size, None (room to allocate one), or False (full)."""
        free = self._free.get(size)
        if self._used + size > self.capacity and not free:
            return False
        got = self.arena.place(size, avoid) if self.arena is not None and self._used + size <= self.capacity else None
        if got is None and (avoid is not None or arena_only):
            return False
        if got is not None:
            got = got[1], got[0]
        elif free:
            got = free.pop(), None
            self._free_bytes -= size
        else:
            self._evict_until(self.capacity - self._used - size)
        self._used += size
        self.peak_used = max(self.peak_used, self._used)
        if got is not None and got[1] is not None:
            self._evict_until(self.capacity - self._used)  # the place may have been clean pages
        return got

    def _buffer(self, got, size: int) -> Buffer:
        if got is not None:
            return Buffer(got[0], self, got[1])
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
        """Drop cached free buffers (largest first), then the arena's free pages, until what the
        pool keeps beyond its buffers in use fits in `room` bytes."""
        arena = self.arena.dirty if self.arena is not None else 0
        for sz in sorted(self._free, reverse=True):
            lst = self._free[sz]
            while lst and self._free_bytes + arena > room:
                lst.pop()
                self._free_bytes -= sz
        for sz in [s for s, lst in self._free.items() if not lst]:
            del self._free[sz]
        if arena and self._free_bytes + arena > room:
            self.arena.discard(self._free_bytes + arena - max(room, 0))

    def _give_back(self, buf: Buffer) -> None:
        with self._cv:
            self._used -= buf.nbytes
            if buf.offset is not None:
                self.arena.free(buf.offset, buf.nbytes)
            else:
                self._free[buf.nbytes].append(buf.tensor)
                self._free_bytes += buf.nbytes
            self._evict_until(self.capacity - self._used)
            self._cv.notify_all()

    def trim(self) -> None:
        """Return every cached free buffer to the OS."""
        with self._cv:
            self._evict_until(0)
