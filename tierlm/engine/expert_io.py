"""The optimizer-state bytes of each expert of the stacked experts' parameters, step by step.

The optimizer reaches the store through a counter that adds the bytes of each request for a key of
a stacked experts' parameter (master, moments, new working weights, saved and accumulated
gradients: `kind<slot>/<name>.<shard>`) to its shard; reads the state cache saves never reach it.
`lap()` turns the shards' counts since the last lap into each (experts module, expert)'s bytes read
and written (a shard of whole experts splits its bytes evenly among them: their shares are equal
in size), and the experts the optimizer left alone (expert_state.py). The weight window's reads
are not in it: a forward reads an experts module's whole stacked tensors, every expert alike.
"""
from __future__ import annotations

import threading

from ..storage.layout import ParamInfo
from ..units import fmt_bytes


class ExpertIO:
    def __init__(self, infos: dict[str, ParamInfo]):
        self.infos = {n: i for n, i in infos.items() if i.experts}
        self._lock = threading.Lock()
        self._shards: dict[tuple[str, int], list[int]] = {}  # (name, shard) -> [read, written] since the lap

    def wrap(self, store):
        """The store as the optimizer sees it: the same, its requests for the stacked experts'
        keys counted (none without stacked experts: the store itself)."""
        return _Counted(store, self) if self.infos else store

    def note(self, key: str, nbytes: int, written: bool) -> None:
        name, _, k = key.partition("/")[2].rpartition(".")
        if name in self.infos:
            with self._lock:
                self._shards.setdefault((name, int(k)), [0, 0])[written] += nbytes

    def lap(self, left_alone: list[tuple[str, int]]) -> dict | None:
        """The bytes since the last lap: totals, per experts module (a layer's `mlp.experts`) each
        expert's [read, written], the experts with none (idle), and the shards the optimizer left
        alone (`left_alone`: OutOfCoreAdamW.skip_log). None for a model without stacked experts."""
        if not self.infos:
            return None
        with self._lock:
            shards, self._shards = self._shards, {}
        per: dict[str, list[list[int]]] = {}
        for n, info in self.infos.items():
            per.setdefault(module_of(n), [[0, 0] for _ in range(info.experts)])
        for (n, k), (rd, wr) in shards.items():
            experts = self.infos[n].shard_experts(k)
            row = per[module_of(n)]
            for e in experts:
                row[e][0] += rd // len(experts)
                row[e][1] += wr // len(experts)
        cells = [c for row in per.values() for c in row]
        return {"read_bytes": sum(c[0] for c in cells), "written_bytes": sum(c[1] for c in cells),
                "experts": len(cells), "idle": sum(1 for c in cells if c == [0, 0]),
                "shards_left_alone": len(set(left_alone)), "per_expert": per}


def module_of(name: str) -> str:
    """The experts module of a stacked parameter's name (`model.layers.3.mlp.experts`)."""
    return name.rpartition(".")[0]


def describe(experts: dict | None) -> str:
    """One line for a step's progress: the experts' state bytes and the experts with none."""
    if not experts:
        return ""
    return (f"experts' state: read {fmt_bytes(experts['read_bytes'])} write {fmt_bytes(experts['written_bytes'])}, "
            f"{experts['idle']} of {experts['experts']} experts untouched ({experts['shards_left_alone']} shards left alone)")


class _Counted:
    """A TensorStore whose reads and writes are counted by an ExpertIO (everything else as is)."""

    def __init__(self, store, io: ExpertIO):
        self._store, self._io = store, io

    def __getattr__(self, attr):
        return getattr(self._store, attr)

    def read_into(self, key: str, out, owns_padding: bool = False, writer: bool = False):
        self._io.note(key, out.numel() * out.element_size(), False)
        return self._store.read_into(key, out, owns_padding, writer=writer)

    def write(self, key: str, tensor, durable: bool = False):
        self._io.note(key, tensor.numel() * tensor.element_size(), True)
        return self._store.write(key, tensor, durable)
