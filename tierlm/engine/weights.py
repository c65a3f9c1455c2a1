"""The weight window: working weights of the blocks around the one computing, and nothing else.

Parameters are read from the store into the window's own pool (its capacity is the window's share
of the `cpu` budget), prefetched ahead of use, pinned while a block runs, and evicted least recently
used first. Forward walks blocks 0..N and backward N..0, so after forward the last blocks are still
resident for the start of backward.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future

import torch

from ..storage import Buffer, BudgetError, HostBufferPool, TensorStore
from ..units import fmt_bytes
from .layout import ParamInfo, nbytes


class _Entry:
    __slots__ = ("buffer", "tensor", "reads", "pins", "tick")

    def __init__(self, buffer: Buffer, tensor: torch.Tensor, reads: list[Future]):
        self.buffer, self.tensor, self.reads = buffer, tensor, reads
        self.pins = 0
        self.tick = None  # None: read ahead and not used yet (evicted last)


class WeightWindow:
    def __init__(self, store: TensorStore, pool: HostBufferPool, infos: dict[str, ParamInfo],
                 dtype: torch.dtype, key_fn):
        """key_fn(name, shard) -> the store key of the current working weights of that shard."""
        self.store, self.pool, self.infos, self.dtype, self.key_fn = store, pool, infos, dtype, key_fn
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()
        self._clock = itertools.count()
        self.hits = 0
        self.misses = 0

    def _bytes(self, name: str) -> int:
        return nbytes(self.dtype, self.infos[name].numel)

    def _load(self, name: str, blocking: bool) -> _Entry | None:
        size = self._bytes(name)
        buf = self.pool.try_acquire(size)
        while buf is None:
            if not self._evict_one(include_unused=blocking):
                if not blocking:
                    return None
                raise BudgetError(
                    f"the weight window ({fmt_bytes(self.pool.capacity)}) cannot hold {name} "
                    f"({fmt_bytes(size)}) beside the blocks in use; raise --cpu-mem")
            buf = self.pool.try_acquire(size)
        info = self.infos[name]
        flat = buf.view(self.dtype, (info.numel,))
        reads = []
        for k, (a, b) in enumerate(info.shards):
            reads.append(self.store.read_into(self.key_fn(name, k), flat[a:b], owns_padding=k == len(info.shards) - 1))
        e = _Entry(buf, flat.view(info.shape), reads)
        self._entries[name] = e
        return e

    def _evict_one(self, include_unused: bool) -> bool:
        """Evict the least recently used unpinned entry; read-ahead entries only if asked."""
        victims = [(n, e) for n, e in self._entries.items() if e.pins == 0 and (e.tick is not None or include_unused)]
        if not victims:
            return False
        name, e = min(victims, key=lambda ne: (ne[1].tick is None, ne[1].tick or 0))
        self._drop(name)
        return True

    def _drop(self, name: str) -> None:
        e = self._entries.pop(name)
        for f in e.reads:
            f.exception()  # a read in flight must land before its buffer is reused
        e.buffer.release()

    def prefetch(self, names) -> None:
        """Start reading `names` if there is room without evicting anything still to be used."""
        with self._lock:
            for n in names:
                if n not in self._entries and self._load(n, blocking=False) is None:
                    return

    def acquire(self, names) -> dict[str, torch.Tensor]:
        """Pin `names` and return their tensors, reading what is missing (blocking)."""
        with self._lock:
            got = {}
            for n in names:
                e = self._entries.get(n)
                if e is None:
                    self.misses += 1
                    e = self._load(n, blocking=True)
                else:
                    self.hits += 1
                e.pins += 1
                got[n] = e
        out = {}
        for n, e in got.items():
            for f in e.reads:
                f.result()  # raises CorruptionError naming the file
            out[n] = e.tensor
        return out

    def release(self, names) -> None:
        with self._lock:
            for n in names:
                e = self._entries[n]
                e.pins -= 1
                e.tick = next(self._clock)

    def invalidate_all(self) -> None:
        """Drop every unpinned entry: the working weights changed (a step committed)."""
        with self._lock:
            for n in [n for n, e in self._entries.items() if e.pins == 0]:
                self._drop(n)
            if self._entries:
                raise RuntimeError(f"weights still pinned at commit: {sorted(self._entries)}")

    def resident_bytes(self) -> int:
        return self.pool.resident_bytes
