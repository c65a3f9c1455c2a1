"""The shards of stacked experts' parameters that no gradient has reached yet, and where each
shard's state is.

transformers stacks a mixture of experts' weights in one parameter per projection ([experts, ...]),
so torch's AdamW updates every expert every step, those no token was routed to as well: their
moments decay, weight decay moves them, the update m̂/(√v̂+ε) moves them. The one case where an
expert's update changes nothing is exact: its moments are still zero (no gradient has reached it
since the run began) and weight decay is 0. Then m = v = 0 and p ← p − lr·0/(0+ε) = p, bit for bit
(fused, foreach and single kernels; -0.0, subnormals and infinities included). Such a shard is
*fresh*: the optimizer reads and writes none of its state in a step whose gradient for it is all
zeros (the layout cuts these parameters on expert boundaries, storage.layout.expert_shards).

A fresh shard has its import's master and working weights in slot 0 and no moments at all, whatever
slot its parameter's other shards are in. Once updated it follows its parameter's slot flips, from
the slot its first update wrote (1): `flipped` are those whose committed slot is then the other one
than their parameter's. `fresh` and `flipped` are committed with the manifest (the optimizer's
state dict); `touched` are the fresh shards updated since the last commit that made a step durable.
"""
from __future__ import annotations

from ..storage.layout import ParamInfo


class ExpertShards:
    """state: the optimizer's persisted dict, holding 'fresh' ({name: [shard, ...]}) and 'flipped'
    where the run tracks fresh shards (one process, weight decay 0 at import); without 'fresh'
    every shard is in its parameter's slot, as for any parameter."""

    def __init__(self, state: dict):
        self.state = state
        self.tracked = "fresh" in state
        self.fresh = {n: set(v) for n, v in state.get("fresh", {}).items()}
        self.flipped = {n: set(v) for n, v in state.get("flipped", {}).items()}
        self.touched: dict[str, set[int]] = {}  # fresh, updated since the last durable commit
        self.step_touched: dict[str, set[int]] = {}  # ... by the step under way

    @staticmethod
    def initial(infos: dict[str, ParamInfo]) -> dict:
        """The import's entries of the optimizer's state: every shard of every stacked experts'
        parameter is fresh."""
        return {"fresh": {n: list(range(len(i.shards))) for n, i in infos.items() if i.experts},
                "flipped": {}}

    def is_fresh(self, name: str, k: int) -> bool:
        """Moments zero and no file for them in the state the step started from (a clip's redo
        of a shard's first update starts from there too)."""
        return k in self.fresh.get(name, ()) and k not in self.touched.get(name, ())

    def committed(self, name: str, k: int, slot: int) -> int:
        """The shard's committed slot, `slot` being its parameter's."""
        if k in self.fresh.get(name, ()):
            return 0
        return slot ^ (k in self.flipped.get(name, ()))

    def newest(self, name: str, k: int, slot: int, newer: bool, pending: bool = False) -> int:
        """The slot of its newest state; newer: its parameter's newest state is in 1 - slot;
        pending: a held step's update beside the next forward is writing the shard's new weights."""
        if k in self.fresh.get(name, ()):
            return 1 if pending or k in self.touched.get(name, ()) else 0
        return (1 - slot if newer else slot) ^ (k in self.flipped.get(name, ()))

    def updated(self, name: str, k: int) -> None:
        """The step under way updated shard k (its first update if it was fresh)."""
        if k in self.fresh.get(name, ()) and k not in self.touched.get(name, ()):
            self.step_touched.setdefault(name, set()).add(k)

    def step_ended(self, committed: bool) -> None:
        """The step's updates became the newest state (committed) or were dropped."""
        if committed:
            for n, ks in self.step_touched.items():
                self.touched.setdefault(n, set()).update(ks)
        self.step_touched = {}

    def made_durable(self, slots: dict[str, int]) -> None:
        """The newest states became the committed ones, `slots` the parameters' new slots: the
        touched shards leave `fresh`, in slot 1 from now on."""
        for n, ks in self.touched.items():
            self.fresh[n] -= ks
            flip = self.flipped.setdefault(n, set())
            for k in ks:
                (flip.add if slots[n] == 0 else flip.discard)(k)
        self.touched = {}
        if self.tracked:
            self.state["fresh"] = {n: sorted(ks) for n, ks in self.fresh.items() if ks}
            self.state["flipped"] = {n: sorted(ks) for n, ks in self.flipped.items() if ks}


def committed_slot(state: dict, name: str, k: int) -> int:
    """A shard's committed slot from the optimizer's persisted state alone (the manifest's keys)."""
    if k in state.get("fresh", {}).get(name, ()):
        return 0
    return state["slots"][name] ^ (k in state.get("flipped", {}).get(name, ()))


def has_moments(state: dict, name: str, k: int) -> bool:
    """Does the committed state hold moment files for shard k (updated at least once)?"""
    return state["steps"][name] > 0 and k not in state.get("fresh", {}).get(name, ())
