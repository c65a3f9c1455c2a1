"""Which shards' optimizer states are read ahead from the store, in what order, how many at once.

Gradients are consumed in the order they arrive (autograd decides the order inside a block);
optimizer state is read ahead in the order seen on the previous micro-batch, so the reads of the
next parameters overlap the backward that is still producing their gradients. The read-ahead
refills per shard, not per parameter: an embedding's 30-odd shards arrive as one parameter, and
refilled only per arrival they ran read, update, write in turn.
"""
from __future__ import annotations

from collections.abc import Callable

from ..storage.layout import ParamInfo
from .optim_types import EARLY, ShardItem


def shards_of(arrival: str, infos: dict[str, ParamInfo], early: dict[str, list[int]]) -> tuple[str, list[int]]:
    """The parameter an arrival updates and its shards (an early arrival: those handed over early,
    `early`; grad_ready's `shards`)."""
    if arrival.endswith(EARLY):
        real = arrival[:-len(EARLY)]
        return real, early.get(real, [])
    return arrival, list(range(len(infos[arrival].shards)))


def update_sequence(arrival: list[str], infos: dict[str, ParamInfo], early: dict[str, list[int]]) -> list[tuple]:
    """The (parameter, shard)s in the order `arrival` updated them: a parameter's shards handed
    over early are updated with their early arrival, not again with the rest."""
    seq, done = [], {}
    for n in arrival:
        real, ks = shards_of(n, infos, early)
        if real != n:
            done[real] = set(ks)
            seq += [(real, k) for k in ks]
        else:
            seq += [(real, k) for k in ks if k not in done.get(real, ())]
    return seq


class ArrivalOrder:
    """The parameters' order of arrival, learnt from each micro-batch for the next one's read-ahead
    (before the first: the order backward produces them in, block by block)."""

    def __init__(self, order: list[str]):
        self.predicted: list[str] = list(order)
        self.last: list[str] = list(order)  # the last micro-batch's arrivals (a clip redo's order)

    def learn(self, arrival: list[str]) -> None:
        self.last = arrival
        seen = set(arrival)
        self.predicted = arrival + [n for n in self.predicted if n not in seen]


class ReadAhead:
    """One pass's read-ahead along `predicted` ((parameter, shard)s): at most `depth` shards
    prepared (buffers taken, reads issued) beside the one being updated, while the pool has room.

    prepare(name, shard, blocking) -> the prepared ShardItem, or None where the pool has no room
    (it gave back what it took); abandon(item) gives a prepared item's buffers back."""

    def __init__(self, predicted: list[tuple], depth: int,
                 prepare: Callable[..., ShardItem | None], abandon: Callable[[ShardItem], None]):
        self.predicted, self.depth = predicted, depth
        self._prepare, self._abandon = prepare, abandon
        self._cursor = 0
        self._prepared: dict[tuple, ShardItem] = {}
        self._done: set[tuple] = set()

    def fill(self) -> None:
        """Read ahead along the predicted order while the pool has room."""
        while self._cursor < len(self.predicted) and len(self._prepared) < self.depth:
            nk = self.predicted[self._cursor]
            if nk in self._done or nk in self._prepared:
                self._cursor += 1
                continue
            it = self._prepare(*nk, blocking=False)
            if it is None:
                break
            self._prepared[nk] = it
            self._cursor += 1

    def take(self, nk: tuple) -> ShardItem:
        """The shard to update now: read ahead already, or prepared now, waiting for room in the
        pool (making room by dropping what was read ahead furthest: this one is needed now)."""
        it = self._prepared.pop(nk, None)
        while it is None:
            it = self._prepare(*nk, blocking=not self._prepared)
            if it is None:
                self._drop(next(reversed(self._prepared)))
        self._done.add(nk)
        return it

    def make_room(self) -> bool:
        """Drop what was read ahead furthest, for a shard needed now; False: nothing is."""
        if not self._prepared:
            return False
        self._drop(next(reversed(self._prepared)))
        return True

    def close(self) -> None:
        """Give back what was read ahead for parameters that got no gradient (or after a failure)."""
        for nk in list(self._prepared):
            self._drop(nk)

    def _drop(self, nk: tuple) -> None:
        it = self._prepared.pop(nk)
        for f in it.reads:
            f.exception()
        self._abandon(it)
