"""OutOfCoreAdamW's part for stacked experts' parameters: the slot of each shard's state, and the
fresh shards (no gradient has reached them yet) left alone in a step whose gradient for them is all
zeros, with weight decay 0: exactly what torch's AdamW does to them (expert_state.py)."""
from __future__ import annotations

import torch

from .expert_state import ExpertShards
from .optim_readahead import ReadAhead
from .optim_types import ShardItem


class ExpertsMixin:
    def _init_experts(self, state: dict, cfg) -> None:
        """Fresh expert shards (expert_state.py): with weight decay 0, one whose gradient is all
        zeros is left alone (`_skip`: this step's; `_zero_acc`: accumulators known to be zero,
        never written); `skip_log`: the shards left alone, for the step's accounting."""
        self.experts = ExpertShards(state)
        self.skip_ok = self.experts.tracked and cfg.weight_decay == 0 and self.dist is None
        self._skip: set[tuple[str, int]] = set()
        self._zero_acc: set[tuple[str, int]] = set()
        self._zero = torch.zeros(1)
        self.skip_log: list[tuple[str, int]] = []

    def read_slot(self, name: str, k: int) -> int:
        """The slot holding the newest state of the parameter's shard k."""
        with self._slot_lock:
            return self.experts.newest(name, k, self.slots[name], name in self.dirty)

    def weights_slot(self, name: str, k: int) -> int:
        """The slot holding (or, while a deferred update writes them, promised) the newest weights
        of shard k."""
        with self._slot_lock:
            pending = name in self._pending_new and (name, k) not in self._skip
            return self.experts.newest(name, k, self.slots[name], name in self.dirty or pending, pending)

    def committed_slot(self, name: str, k: int) -> int:
        with self._slot_lock:
            return self.experts.committed(name, k, self.slots[name])

    def write_slot(self, name: str, k: int) -> int:
        """The slot a step writes shard k's new state to: the one its committed state is not in."""
        return 1 - self.committed_slot(name, k)

    def _left_alone(self, mode: str, name: str, k: int) -> bool:
        """A clip's redo or a held step's update passes over the shards the first pass left alone."""
        return mode in ("redo", "apply") and (name, k) in self._skip

    def _lazy(self, it: ShardItem, mode: str, micro: int, ahead: ReadAhead) -> bool:
        """A fresh expert shard (accumulated gradient zero so far): left alone where its gradient is
        all zeros (True), else its state is read now, the accumulator, known zero, not."""
        if not bool(self.queue.grads[it.src].reshape(-1)[it.a:it.b].any()):
            if it.last:
                self.queue.done_with(it.src)
            self._leave(it, mode, micro)
            return True
        it.lazy, it.acc_zero = False, micro > 0
        self._zero_acc.discard((it.name, it.shard))
        # (as ReadAhead.take: what was read ahead furthest makes room where the pool has none)
        while not self.reader.prepare(it, mode, micro, blocking=False):
            if not ahead.make_room():
                self.reader.prepare(it, mode, micro, blocking=True)
                break
        return False

    def _leave(self, it: ShardItem, mode: str, micro: int) -> None:
        """Leave a fresh shard with an all-zero gradient alone: torch's AdamW (weight decay 0) would
        leave it as it is, and its moments zero (expert_state.py)."""
        nk = (it.name, it.shard)
        if mode == "accumulate":
            self._zero_acc.add(nk)  # the accumulator is not written: the next micro-batch knows it zero
            return
        self._zero_acc.discard(nk)
        self._skip.add(nk)
        self.skip_log.append(nk)
        if micro > 0:
            self._record_norm(it, self._zero)  # its part of the accumulated gradient's norm
        if mode == "hold":
            self._held.add(it.name)
            return
        self._updated.add(it.name)  # (torch counts the step for the whole tensor)
        if self.on_unchanged is not None:
            self.on_unchanged(it.name, it.shard)

    def _pass_over(self, name: str, alone: list[int], mode: str) -> None:
        """A held step's update of shards the first pass left alone: their weights stand."""
        if mode != "apply":
            return
        self._updated.add(name)
        for k in alone:
            if self.on_unchanged is not None:
                self.on_unchanged(name, k)
