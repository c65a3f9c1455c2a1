"""A shard's optimizer state brought into RAM for its update: buffers from the pool (or the state
cache's), and the reads of master, m and v from the current slot, the saved gradient (a clip redo)
or the gradient accumulator (later micro-batches)."""
from __future__ import annotations

import torch

from ..storage import BudgetError, HostBufferPool, TensorStore
from ..storage.aligned import round_up
from ..storage.layout import key, nbytes
from ..units import fmt_bytes
from .cache_policy import StateCache
from .optim_types import ShardItem, StateFormat


class ShardReader:
    """slot_of(name, shard): the slot holding the shard's newest state; steps: the updates each
    parameter has had (the optimizer advances them as steps end)."""

    def __init__(self, store: TensorStore, pool: HostBufferPool, fmt: StateFormat, cache: StateCache,
                 slot_of, steps: dict[str, int]):
        self.store, self.pool, self.fmt, self.cache = store, pool, fmt, cache
        self.slot_of, self.steps = slot_of, steps

    def saved_grad_dtype(self, it: ShardItem) -> torch.dtype:
        """The dtype the shard's gradient was saved in for a clip redo."""
        return getattr(torch, self.store.landed_record(key("grad", it.name, it.shard)).dtype)

    def prepare(self, it: ShardItem, mode: str, micro: int, blocking: bool) -> bool:
        """Take the buffers `mode` (update | accumulate | redo | hold | apply) needs and issue the
        reads; False (having given back what it took) where the pool has no room and `blocking` is
        off. hold: the gradient is saved and nothing read (the accumulator on later micro-batches);
        apply: the committed state (from the cache where it is kept) and the saved gradient."""
        n = it.b - it.a
        saved_dtype = self.saved_grad_dtype(it) if mode in ("redo", "apply") else None
        if mode == "redo":
            self.cache.unstage((it.name, it.shard))
        cached = self._from_cache(it, mode, n)
        sizes = {tag: nbytes(saved_dtype, n) if tag == "gl" else self.fmt.size(tag, n, it.name)
                 for tag in self._needs(mode, micro, saved_dtype) if tag not in it.bufs}
        if blocking and sum(round_up(max(s, 1)) for s in sizes.values()) > self.pool.capacity:
            # taken one by one, they would wait forever for the room they hold themselves
            self.abandon(it)
            raise BudgetError(f"{self.pool.name}: one shard of {it.name} in a {mode} needs "
                              f"{fmt_bytes(sum(sizes.values()))} ({', '.join(sizes)}), more than the whole pool "
                              f"({fmt_bytes(self.pool.capacity)}); raise --cpu-mem")
        for tag, size in sizes.items():
            if not self._acquire(it, tag, size, blocking):
                self.abandon(it)
                return False
        self._read(it, mode, micro, cached, saved_dtype)
        return True

    def abandon(self, it: ShardItem) -> None:
        """Give up a prepared item: a cache hit's state goes back to the cache (it is still the
        committed state), the rest to the pools."""
        if it.cached:
            self.cache.put_back((it.name, it.shard), {t: it.bufs.pop(t) for t in it.cached})
            it.cached = set()
            it.keep = set()
        it.release()

    def _needs(self, mode: str, micro: int, saved_dtype: torch.dtype | None) -> list[str]:
        need = []
        if mode in ("update", "redo", "apply"):
            need += ["master", "m", "v"] + (["qm", "qv"] if self.fmt.quant else [])
            if self.fmt.weight_dtype is not None:
                need.append("w")
        if mode == "hold":
            return ["g"] if micro > 0 else []  # the accumulator; a first gradient is saved as handed over
        if mode in ("redo", "apply") or micro > 0 or self.fmt.weight_dtype is not None:
            # the saved gradient (redo), the accumulator (later micro-batches), or the fp32 copy
            # of a low-precision gradient
            need.append("g")
        if saved_dtype is not None and saved_dtype != torch.float32:
            need.append("gl")  # the saved gradient in its own (low) precision
        return need

    def _from_cache(self, it: ShardItem, mode: str, n: int) -> dict | None:
        """The committed state if resident (returned), or buffers of the cache's to keep the new
        state in; `it.keep`: the buffers that stay resident after the step."""
        nk = (it.name, it.shard)
        cached = self.cache.take(nk) if mode in ("update", "apply") else None
        if cached:
            it.bufs.update(cached)
            # a shard no longer among the last: used once more, then its buffers go back to the cache
            it.keep = set(cached) if self.cache.keeps(nk) else set()
            it.cached = set(cached)
        elif mode in ("update", "redo", "apply") and self.cache.keeps(nk):
            got = self.cache.reserve(n)
            if got is not None:
                it.bufs.update(got)
                it.keep = set(got)
        return cached

    def _acquire(self, it: ShardItem, tag: str, size: int, blocking: bool) -> bool:
        # read-ahead waits for a place in the pool's arena rather than take fresh pages beside it
        buf = self.pool.acquire(size) if blocking else self.pool.try_acquire(size, arena_only=True)
        if buf is None:
            return False
        it.bufs[tag] = buf
        return True

    def _read(self, it: ShardItem, mode: str, micro: int, cached: dict | None,
              saved_dtype: torch.dtype | None) -> None:
        n = it.b - it.a
        slot = self.slot_of(it.name, it.shard)
        view = lambda tag: self.fmt.view(it.bufs, tag, n)
        if mode in ("update", "redo", "apply") and not cached:
            # a held step's deferred update reads the master its own promised write replaces (fp32
            # weights are the master; between commits the slot is rewritten in place)
            it.reads.append(self.store.read_into(key("master", it.name, it.shard, slot), view("master"), True,
                                                 writer=mode == "apply"))
            if self.steps[it.name] > 0 and not it.fresh:
                m, v = ("qm", "qv") if self.fmt.quant else ("m", "v")
                it.reads.append(self.store.read_into(key("m", it.name, it.shard, slot), view(m), True))
                it.reads.append(self.store.read_into(key("v", it.name, it.shard, slot), view(v), True))
            elif not self.fmt.quant:  # (compressed modes start m, v at zero in the update)
                view("m").zero_()
                view("v").zero_()
        if mode in ("redo", "apply"):
            dst = view("g") if saved_dtype == torch.float32 else it.bufs["gl"].view(saved_dtype, (n,))
            it.reads.append(self.store.read_into(key("grad", it.name, it.shard), dst, True))
        elif micro > 0 and it.acc_zero:  # never written: the earlier micro-batches' sum is zero
            view("g").zero_()
        elif micro > 0:
            it.reads.append(self.store.read_into(key("gacc", it.name, it.shard), view("g"), True))
