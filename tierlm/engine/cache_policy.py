"""Which optimizer-state shards the state cache keeps between steps: those updated last.

A cache filled in arrival order holds the first shards a step updates (the head's, the last
layers'). Then the step ends with the last shards' reads, compute done and the drive reading and
writing their states one after the other (TinyLlama 1x128 under 4 GiB, a 2-vCPU Zen 4 VM: the embedding's
0.92 GB of reads took the last 2.1 s of an 11.7 s step). Cached instead, the last shards update as
soon as their gradients arrive and their writes land early in the next forward, which only reads
weights and left the drive ~40% idle; the first shards' reads overlap backward's start, the head's
backward among it, when the drive was idle (steps 0.95x, docs/benchmarks.md at a2b1c1e).

`StateCache` holds those states for the optimizer; `last_that_fit` picks them.
"""
from __future__ import annotations

from ..storage import HostBufferPool
from ..storage.aligned import round_up
from ..storage.layout import ParamInfo
from .optim_types import StateFormat


def last_that_fit(seq: list, size_of, capacity: int) -> set:
    """The longest suffix of `seq` (shard keys in update order) whose sizes sum within `capacity`."""
    room, keep = capacity, set()
    for nk in reversed(seq):
        if nk in keep:
            continue
        size = size_of(nk)
        if size > room:
            break
        room -= size
        keep.add(nk)
    return keep


class StateCache:
    """The shards' committed states held in RAM between steps, in buffers of the state cache's
    pool (None: no cache, every state is read). A resident shard's reads are skipped; its writes
    still happen, so every step is durable and the cache can be dropped at any time. From the
    second step it keeps the shards updated last (prefer_last); a step's new states are staged and
    become resident when the step commits (the next step sees exactly what the disk holds)."""

    def __init__(self, pool: HostBufferPool | None, fmt: StateFormat):
        self.pool, self.fmt = pool, fmt
        self.resident: dict[tuple, dict] = {}  # (name, shard) -> {tag: Buffer}: the committed state
        self.staged: dict[tuple, dict] = {}    # this step's new state, resident once committed
        self.preferred: set | None = None      # the shards the cache keeps (None: the first that fit)
        self.unwritten: set[tuple] = set()     # resident states not on disk yet (between commits)
        self.hits = 0

    def resident_bytes(self) -> int:
        """Bytes of the states held between steps (what a commit writes when steps skip them)."""
        return sum(b.nbytes for bufs in self.resident.values() for b in bufs.values())

    def keeps(self, nk: tuple) -> bool:
        return self.preferred is None or nk in self.preferred

    def take(self, nk: tuple) -> dict | None:
        """A resident shard's committed state (a hit): its buffers are the caller's until it
        stages them again or puts them back."""
        bufs = self.resident.pop(nk, None)
        if bufs:
            self.hits += 1
        return bufs

    def put_back(self, nk: tuple, bufs: dict) -> None:
        """A hit given up unused: its buffers still hold the committed state (releasing them would
        cost a re-read next step)."""
        self.resident[nk] = bufs
        self.hits -= 1

    def reserve(self, n: int) -> dict | None:
        """Buffers from the cache's pool for a whole n-element state, or None: a partial set would
        be taken for the whole state next step."""
        if self.pool is None:
            return None
        got = {}
        for tag in self.fmt.state_tags:
            buf = self.pool.try_acquire(self.fmt.size(tag, n))
            if buf is None:
                _release(got)
                return None
            got[tag] = buf
        return got

    def stage(self, nk: tuple, bufs: dict) -> None:
        """This step's new state of a shard stays in RAM (a clip redo replaces it)."""
        _release(self.staged.pop(nk, None))
        self.staged[nk] = bufs

    def unstage(self, nk: tuple) -> None:
        """A redo: the speculative values staged for this shard are not the state."""
        _release(self.staged.pop(nk, None))

    def commit(self) -> None:
        self.resident.update(self.staged)
        self.staged = {}

    def discard(self) -> None:
        """A step not taken: the states it staged go back to the pool (the disk has the state)."""
        for bufs in self.staged.values():
            _release(bufs)
        self.staged = {}

    def drop(self) -> None:
        """Hand every resident state back (with nothing in flight, none unwritten: the optimizer
        flushes first); a later step reads them."""
        if self.unwritten:
            raise RuntimeError(f"state cache dropped with {len(self.unwritten)} shards not on disk")
        for bufs in self.resident.values():
            _release(bufs)
        self.resident = {}

    def prefer_last(self, seq: list[tuple], infos: dict[str, ParamInfo]) -> None:
        """Keep the shards updated last in `seq`'s order (shard keys in update order) that fit."""
        if self.pool is None:
            return

        def size_of(nk):
            a, b = infos[nk[0]].shards[nk[1]]
            return sum(round_up(self.fmt.size(tag, b - a)) for tag in self.fmt.state_tags)
        self.preferred = last_that_fit(seq, size_of, self.pool.capacity)


def _release(bufs: dict | None) -> None:
    for b in (bufs or {}).values():
        b.release()
