"""The process group, this rank's place in it, and who owns which parameter.

torchrun sets RANK / WORLD_SIZE / MASTER_ADDR...; we join with gloo (the engine computes and keeps
its tensors on the CPU, which NCCL cannot carry) and a finite timeout, so a peer that died or hangs
fails the collective, and the job, instead of blocking it forever.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as td

from .. import faults


def in_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def owners_by_bytes(numels: dict[str, int], world: int) -> dict[str, int]:
    """Each parameter to one rank, balanced by size: largest first to the least-loaded rank (ties:
    canonical order, then the lower rank), so every rank and every later run computes the same map."""
    load = [0] * world
    owners = {}
    names, sizes = list(numels), list(numels.values())
    for i in sorted(range(len(names)), key=lambda i: -sizes[i]):
        r = min(range(world), key=lambda j: (load[j], j))
        owners[names[i]] = r
        load[r] += numels[names[i]]
    return {n: owners[n] for n in names}


class Dist:
    """One data-parallel rank. world == 1 without a process group is allowed (every collective is
    the identity), so a 1-rank run uses the same per-rank layout as an N-rank one."""

    def __init__(self, rank: int, world: int, timeout_s: float = 300.0, group: bool = True):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.owners: dict[str, int] = {}
        self._pg = group and world > 1
        self.backend = td.get_backend() if self._pg else None

    # ---- collectives (identity on one rank) ----------------------------------------------
    def all_reduce(self, t: torch.Tensor, op=td.ReduceOp.SUM) -> torch.Tensor:
        if self._pg:
            td.all_reduce(t, op=op)
        return t

    def agree(self, ok: bool = True, what: str = "step") -> None:
        """Every rank reached this point with `ok`; raise on all of them if any one did not."""
        flag = self.all_reduce(torch.tensor([1 if ok else 0], dtype=torch.int64), td.ReduceOp.MIN)
        if not int(flag):
            raise RuntimeError(f"rank {self.rank}: another rank failed during the {what}; nothing was committed")

    def barrier(self) -> None:
        if self._pg:
            self.all_reduce(torch.zeros(1))  # a gloo barrier that honours the group's timeout

    def same_on_all(self, value: int, what: str) -> None:
        lo = self.all_reduce(torch.tensor([value], dtype=torch.int64), td.ReduceOp.MIN)
        hi = self.all_reduce(torch.tensor([value], dtype=torch.int64), td.ReduceOp.MAX)
        if int(lo) != int(hi):
            raise RuntimeError(f"the ranks disagree on the {what} ({int(lo)} .. {int(hi)}); "
                               f"rank {self.rank} has {value}")

    # ---- ownership -----------------------------------------------------------------------
    def set_params(self, numels: dict[str, int]) -> None:
        self.owners = owners_by_bytes(numels, self.world)

    def owns(self, name: str) -> bool:
        return self.owners[name] == self.rank

    def describe(self) -> dict:
        return {"world": self.world, "rank": self.rank, "owners": dict(self.owners)}

    def close(self) -> None:
        if self._pg and td.is_initialized():
            td.destroy_process_group()
            self._pg = False


def from_env(timeout_s: float = 300.0) -> Dist | None:
    """The Dist for this process when torchrun started it, else None (one plain process)."""
    if not in_torchrun():
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a stuck rank waits
    if timeout_s <= 0:
        raise ValueError(f"--dist-timeout must be positive seconds, got {timeout_s}")
    _fault_only_on_chosen_rank(rank)
    if world > 1 and not td.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        td.init_process_group("gloo", store=_attempt_store(rank, world, timeout), rank=rank,
                              world_size=world, timeout=timeout)
    return Dist(rank, world, timeout_s)


def _attempt_store(rank: int, world: int, timeout: timedelta):
    """The rendezvous store under a prefix of its own per torchrun attempt: a restart reuses the
    agent's store, where the dead attempt's gloo addresses would otherwise still be found (the
    restarted ranks then wait on peers that no longer exist)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = td.TCPStore(host, port, world, is_master=not agent and rank == 0, timeout=timeout,
                        multi_tenant=not agent)
    return td.PrefixStore(f"tierlm/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _fault_only_on_chosen_rank(rank: int) -> None:
    """TIERLM_FAULT_RANK=r: the TIERLM_FAULT plan fires on rank r only, and only in the first
    attempt (torchrun's restarts run without it), so a test can kill one rank once."""
    chosen = os.environ.get("TIERLM_FAULT_RANK")
    if chosen is None:
        return
    if int(chosen) != rank or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        faults._PLAN.clear()
