"""The weight window: working weights of the blocks around the one computing, and nothing else.

Parameters are read from the store into the window's own pool (its capacity is the window's share
of the `cpu` budget), prefetched ahead of use, pinned while a block runs, and evicted least recently
used first. Forward walks blocks 0..N and backward N..0, so after forward the last blocks are still
resident for the start of backward, and after backward the first blocks are resident for the next
forward. The optimizer hands every updated shard of working weights to `offer` before writing it:
an entry no block is using takes the new values in place, and an entry whose every shard was
renewed survives the commit, so the next forward does not read back what the step just wrote.
A block still computing holds its entry when the optimizer finishes its first shards (a layer's
weight gradients come before its backward ends): with `stash`, the new values go into a second
buffer from the pool's free room, which replaces the entry's once the block lets go of it.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future

import torch

from ..storage import Buffer, BudgetError, HostBufferPool, TensorStore
from ..units import fmt_bytes
from ..storage.layout import ParamInfo, nbytes


class _Entry:
    __slots__ = ("buffer", "tensor", "reads", "pins", "tick", "renewed", "fresh", "awaiting", "stale")

    def __init__(self, buffer: Buffer, tensor: torch.Tensor, reads: list[Future]):
        self.buffer, self.tensor, self.reads = buffer, tensor, reads
        self.awaiting: set[int] = set()  # shards a deferred update has still to renew (await_renewal)
        self.pins = 0
        self.tick = None  # None: read ahead and not used yet (evicted last)
        self.renewed: set[int] = set()  # shards holding this step's new values
        # (buffer, tensor) holding the renewed shards where a block held `tensor` at the offer
        self.fresh: tuple[Buffer, torch.Tensor] | None = None
        # shards holding no values: the stash became the entry before they were offered
        self.stale: set[int] = set()


class WeightWindow:
    def __init__(self, store: TensorStore, pool: HostBufferPool, infos: dict[str, ParamInfo],
                 dtype_of, key_fn, stash: bool = False):
        """dtype_of(name) -> the dtype of a parameter's working weights; key_fn(name, shard) -> the
        store key of the current working weights of that shard.
        stash: keep the new values of entries a block holds at the offer (the window has room for
        every weight: budget.Split.weights_kept); without room to spare the copies would take the
        room that reading ahead needs."""
        self.store, self.pool, self.infos, self.dtype_of, self.key_fn = store, pool, infos, dtype_of, key_fn
        self.stash = stash
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()
        self._renewal = threading.Condition(self._lock)
        self._failed: BaseException | None = None  # what stopped the deferred update being awaited
        self._deferring: set[str] = set()  # the parameters a deferred update is renewing (await_renewal)
        self._clock = itertools.count()
        self.hits = 0
        self.misses = 0
        self.renewed_bytes = 0  # new weights taken in place (not read back from the store)
        self.kept_bytes = 0     # bytes of entries that survived the last commit

    def _bytes(self, name: str) -> int:
        return nbytes(self.dtype_of(name), self.infos[name].numel)

    def _load(self, name: str, blocking: bool) -> _Entry | None:
        size = self._bytes(name)
        buf = None
        if self.pool.arena is not None and size >= self.pool.capacity // 8:
            buf = self._make_room(size)
        if buf is None:
            buf = self.pool.try_acquire(size, arena_only=True)
        while buf is None:
            # an entry used already (the window would soon evict it anyway) rather than fresh pages
            # beside the arena; those rather than an entry read ahead (it would be read again)
            if self._evict_one(include_unused=False):
                buf = self.pool.try_acquire(size, arena_only=True)
                continue
            buf = self.pool.try_acquire(size)
            if buf is not None or not blocking:
                break
            if not self._evict_one(include_unused=True):
                raise BudgetError(
                    f"the weight window ({fmt_bytes(self.pool.capacity)}) cannot hold {name} "
                    f"({fmt_bytes(size)}) beside the blocks in use; raise --cpu-mem")
            buf = self.pool.try_acquire(size)
        if buf is None:
            return None
        info = self.infos[name]
        flat = buf.view(self.dtype_of(name), (info.numel,))
        reads = []
        for k, (a, b) in enumerate(info.shards):
            reads.append(self.store.read_into(self.key_fn(name, k), flat[a:b], owns_padding=k == len(info.shards) - 1))
        e = _Entry(buf, flat.view(info.shape), reads)
        self._entries[name] = e
        return e

    def _make_room(self, size: int) -> Buffer | None:
        """For a large parameter (a tied embedding takes most of a small window): free one
        contiguous range of the pool's arena, so that it lands in pages already resident, not in
        fresh ones (which the kernel zeroes: 272 MB a step for Qwen2.5-0.5B's head). The range is
        the one whose most recently used entry is the oldest; entries read ahead and not used yet
        are moved out of it (a copy), not dropped (a read again), and only where no range of used
        entries will do."""
        moved = float(1 << 40)
        # (an entry still reading is not moved: its read may wait for a deferred update's write)
        movable = {e.buffer: (moved if e.tick is None else e.tick) for e in self._entries.values()
                   if e.pins == 0 and all(f.done() for f in e.reads)}
        got = self.pool.to_free_for(size, movable)
        if got is None:
            return None
        victims, span = set(got[0]), got[1]
        moving = []
        for n, e in list(self._entries.items()):
            if e.buffer in victims:
                if e.tick is None:
                    moving.append(n)
                else:
                    self._drop(n)
        while self.pool.used_bytes + size > self.pool.capacity and self._evict_one(include_unused=False):
            pass
        for n in moving:
            self._move(n, span)
        return self.pool.try_acquire(size)

    def _move(self, name: str, avoid: tuple[int, int]) -> None:
        """Copy an unpinned entry into a buffer outside `avoid`; drop it where there is none."""
        e = self._entries[name]
        buf = self.pool.try_acquire(e.buffer.nbytes, avoid=avoid)
        if buf is None or any(f.exception() is not None for f in e.reads):
            if buf is not None:
                buf.release()
            self._drop(name)  # read again when needed (a failed read raises then)
            return
        info = self.infos[name]
        flat = buf.view(self.dtype_of(name), (info.numel,))
        flat.copy_(e.tensor.view(-1))
        old, e.buffer, e.tensor, e.reads = e.buffer, buf, flat.view(info.shape), []
        old.release()

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
        if e.awaiting:
            self._renewal.notify_all()  # a block waiting for its renewal reads it instead
        for f in e.reads:
            f.exception()  # a read in flight must land before its buffer is reused
        e.buffer.release()
        if e.fresh is not None:
            e.fresh[0].release()

    def prefetch(self, names) -> None:
        """Start reading `names` if there is room without evicting anything still to be used."""
        with self._lock:
            for n in names:
                if n not in self._entries and self._load(n, blocking=False) is None:
                    return

    def ready(self, names) -> bool:
        """Are all of `names` in the window with their reads landed (acquire would not wait)?"""
        with self._lock:
            for n in names:
                e = self._entries.get(n)
                if e is None or e.renewed or e.awaiting or not all(f.done() for f in e.reads):
                    return False
        return True

    def await_renewal(self, names) -> None:
        """A step whose update runs beside the next forward committed: the entries of `names` it
        updates stay, to take the new values as the update offers them, and a block acquiring one
        waits until every shard is renewed; every other entry not renewed is dropped (it holds old
        weights). Entries the update does not touch keep theirs."""
        names = set(names)
        with self._lock:
            self._failed = None
            self._deferring = names
            for n, e in list(self._entries.items()):
                if e.pins:
                    raise RuntimeError(f"weights still pinned at commit: {n}")
                if n in names:
                    for f in e.reads:
                        f.result()
                    e.awaiting, e.renewed, e.tick = set(range(len(self.infos[n].shards))), set(), None
            self.kept_bytes = sum(self._bytes(n) for n in self._entries)

    def _renew(self, name: str, shard: int, values: torch.Tensor) -> None:
        e = self._entries.get(name)
        if e is None or not e.awaiting:
            return  # (an entry read since holds what the update wrote: its read waited)
        a, b = self.infos[name].shards[shard]
        e.tensor.view(-1)[a:b].copy_(values)
        e.awaiting.discard(shard)
        self.renewed_bytes += values.numel() * values.element_size()
        if not e.awaiting:
            self._renewal.notify_all()

    def end_renewal(self) -> None:
        """The deferred update is over: offers are the next step's again, and an entry it did not
        renew (its offer skipped) leaves, to be read from what it wrote."""
        with self._lock:
            self._deferring = set()
            for n in [n for n, e in self._entries.items() if e.awaiting and not e.pins]:
                self._drop(n)
            self._renewal.notify_all()

    def fail_awaiting(self, error: BaseException) -> None:
        """The deferred update stopped: blocks waiting for its weights raise `error`."""
        with self._lock:
            self._failed = error
            for n in [n for n, e in self._entries.items() if e.awaiting and not e.pins]:
                self._drop(n)
            self._renewal.notify_all()

    def _wait_renewed(self, name: str, e: _Entry) -> None:
        """Caller holds the lock; waits (releasing it) until a deferred update renewed `e` (or
        it left the window)."""
        while e.awaiting and self._entries.get(name) is e:
            if self._failed is not None:
                raise self._failed
            self._renewal.wait(0.5)

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
                    self._wait_renewed(n, e)
                    while self._entries.get(n) is not e:  # dropped meanwhile: read what the update wrote
                        e = self._entries.get(n) or self._load(n, blocking=True)
                        self._wait_renewed(n, e)
                    if e.renewed:
                        raise RuntimeError(f"{n}: a forward between the last backward of a step and "
                                           f"step() would see a mix of old and new weights; call step() first")
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
                if e.pins == 0 and e.fresh is not None:
                    # no block uses the old values any more: the stash becomes the entry now (as an
                    # offer to an unused entry would have been), so stashes do not pile up until
                    # the commit (they had taken a whole backward's worth of the window)
                    old, (e.buffer, e.tensor), e.fresh = e.buffer, e.fresh, None
                    old.release()
                    e.stale = set(range(len(self.infos[n].shards))) - e.renewed

    def offer(self, name: str, shard: int, values: torch.Tensor) -> None:
        """The step's new working weights of one shard (called before they are written). Only an
        entry no block holds takes them: until the commit, nothing reads a parameter whose update
        has started (backward is past its block, and a clip redo reads from the store); with
        `stash`, one a block holds takes them in a second buffer (the old values stay for the block)."""
        if name in self._deferring:  # a deferred update's: the step is already committed
            # The compute thread may hold the window while it waits for a read that waits for this
            # update's next writes: then the offer is skipped (the entry is read back at the
            # update's end) rather than the update standing still. Either way the same bits.
            if not self._lock.acquire(timeout=0.05):
                return
            try:
                self._renew(name, shard, values)
            finally:
                self._lock.release()
            return
        with self._lock:
            e = self._entries.get(name)
            if e is None or (e.pins and not self.stash):
                return
            for f in e.reads:
                f.result()
            if e.pins and e.fresh is None:
                buf = self.pool.try_acquire(e.buffer.nbytes)
                if buf is None:
                    return
                info = self.infos[name]
                flat, held = buf.view(self.dtype_of(name), (info.numel,)), e.tensor.view(-1)
                # only the shards renewed in place before the block took the entry: the others are
                # offered into the stash, or the entry is not whole at the commit and is dropped
                for k in e.renewed:
                    lo, hi = info.shards[k]
                    flat[lo:hi].copy_(held[lo:hi])
                e.fresh = (buf, flat.view(e.tensor.shape))
            a, b = self.infos[name].shards[shard]
            (e.fresh[1] if e.fresh is not None else e.tensor).view(-1)[a:b].copy_(values)
            e.renewed.add(shard)
            if e.fresh is None:
                e.stale.discard(shard)
            self.renewed_bytes += values.numel() * values.element_size()

    def unchanged(self, name: str, shard: int) -> None:
        """The step left one shard's weights as they were (a fresh expert shard: expert_state.py):
        an entry holding them holds the new ones, as if offered."""
        if name in self._deferring:
            if not self._lock.acquire(timeout=0.05):
                return  # (as an offer: the entry is read back at the update's end)
            try:
                e = self._entries.get(name)
                if e is not None and e.awaiting:
                    e.awaiting.discard(shard)
                    if not e.awaiting:
                        self._renewal.notify_all()
            finally:
                self._lock.release()
            return
        with self._lock:
            e = self._entries.get(name)
            if e is None or (e.pins and not self.stash) or shard in e.stale:
                return  # (an entry not renewed whole is dropped at the commit, then read again)
            for f in e.reads:
                f.result()
            if e.fresh is not None:  # a stash holds the renewed shards: this one's values too
                a, b = self.infos[name].shards[shard]
                e.fresh[1].view(-1)[a:b].copy_(e.tensor.view(-1)[a:b])
            e.renewed.add(shard)  # (a stash made later copies the renewed shards from the entry)

    def invalidate_all(self, keep_renewed: bool = True) -> None:
        """A step committed (keep_renewed) or was dropped: keep the entries whose every shard holds
        the new weights, drop every other unpinned one (it holds the old weights, or a mix)."""
        with self._lock:
            for n, e in list(self._entries.items()):
                if e.pins == 0 and not (keep_renewed and len(e.renewed) == len(self.infos[n].shards)):
                    self._drop(n)
                else:
                    e.renewed, e.stale = set(), set()
                    # kept for the next forward, which needs them before anything it reads ahead:
                    # as read-ahead entries, prefetch cannot evict them (by the last use in
                    # backward they were the least recently used, and prefetching block i+2
                    # dropped block i+1's weights, which were then read again behind it)
                    e.tick = None
            pinned = sorted(n for n, e in self._entries.items() if e.pins)
            if pinned:
                raise RuntimeError(f"weights still pinned at commit: {pinned}")
            self.kept_bytes = sum(self._bytes(n) for n in self._entries)

    def resident_bytes(self) -> int:
        return self.pool.resident_bytes
