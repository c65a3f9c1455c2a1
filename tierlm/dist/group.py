"""The process group, this rank's place in it, and who owns which parameter.

torchrun sets RANK / WORLD_SIZE / MASTER_ADDR...; we join with gloo and a finite timeout, so a peer
that died or hangs fails the collective, and the job, instead of blocking it forever. The default
group is gloo on every device: the loss shares, gradient norms, agreement flags, state checks and the
owners' new weights are host tensors (the optimizer and the weight window live in host memory),
which NCCL cannot carry. Where the run computes on CUDA, each rank takes the GPU cuda:LOCAL_RANK and
an NCCL group beside the gloo one carries the gradients, reduced on the device in buckets (buckets.py).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as td

from .. import faults

DEFAULT_BUCKET_BYTES = 25 * 2**20  # fp32 gradient bytes per NCCL reduce (buckets.py)


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

    def __init__(self, rank: int, world: int, timeout_s: float = 300.0, group: bool = True,
                 device: str = "cpu", bucket_bytes: int = 0, grad_group=None):
        """device: where this rank computes (its gradients are reduced there); bucket_bytes: 0 reduces
        each parameter's gradient alone (the CPU path), else buckets of about that many fp32 bytes;
        grad_group: the process group of the gradient reductions (None: the default, gloo)."""
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.owners: dict[str, int] = {}
        self._pg = group and world > 1
        self.backend = td.get_backend() if self._pg else None
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.grad_group = grad_group
        self.grad_backend = grad_backend(self.device) if self._pg else None

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
            td.destroy_process_group()  # the NCCL group with it
            self._pg = False
            self.grad_group = None


def grad_backend(device: torch.device) -> str:
    """The backend that reduces the gradients: NCCL where they are on a GPU, else gloo."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, local_rank: int, local_world: int, visible: int) -> str:
    """This rank's compute device: on CUDA, the GPU cuda:LOCAL_RANK (whatever index --device named:
    every rank is given the same --device; choose the GPUs with CUDA_VISIBLE_DEVICES)."""
    if torch.device(device).type != "cuda":
        return device
    if visible < local_world:
        raise ValueError(f"--device {device} with {local_world} ranks on this machine: each rank computes on "
                         f"a GPU of its own (cuda:LOCAL_RANK) and {visible} GPU(s) are visible; use at most "
                         f"--nproc {visible}, or --device cpu")
    return f"cuda:{local_rank}"


def check_group_backend(device: str, backend: str) -> None:
    """A process group someone else initialized must carry host tensors (gloo): the CPU-side
    collectives use the default group. NCCL alone cannot, and with --device cpu nothing is on a GPU."""
    if "gloo" in backend:
        return
    if torch.device(device).type == "cpu":
        raise ValueError(f"--device cpu with a {backend} process group: the CPU path's collectives are gloo's; "
                         f"initialize the group with \"gloo\" (or \"cpu:gloo,cuda:nccl\"), or compute on CUDA")
    raise ValueError(f"a {backend} process group cannot carry the host tensors of the optimizer's collectives; "
                     f"initialize it with \"gloo\" or \"cpu:gloo,cuda:nccl\" (tierlm adds the NCCL group itself)")


def check_gpus(device: str, nproc: int) -> None:
    """Before torchrun starts `nproc` ranks on this machine (tierlm finetune --nproc)."""
    rank_device(device, 0, nproc, torch.cuda.device_count() if torch.device(device).type == "cuda" else 0)


def from_env(timeout_s: float = 300.0, device: str = "cpu", bucket_bytes: int | None = None) -> Dist | None:
    """The Dist for this process when torchrun started it, else None (one plain process).
    device: the run's --device (resolved); on CUDA this rank takes cuda:LOCAL_RANK and its
    gradients go over NCCL in buckets of `bucket_bytes` (None: 25 MiB). On the CPU each parameter's
    gradient is reduced alone over gloo whatever `bucket_bytes` says (the path whose bits the tests
    pin; a Dist's bucket_bytes set by hand buckets it there too, as tests/dist/test_buckets.py does)."""
    if not in_torchrun():
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = torch.device(device).type == "cuda"
    device = rank_device(device, local_rank, local_world, torch.cuda.device_count() if cuda else 0)
    bucket_bytes = (DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes) if cuda else 0
    if cuda:
        if world > 1 and not td.is_nccl_available():
            raise ValueError(f"--device {device} with {world} ranks: this build of PyTorch has no NCCL; "
                             "use --device cpu (gloo)")
        torch.cuda.set_device(torch.device(device))  # NCCL's communicator and every default "cuda" here
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a stuck rank waits
    if timeout_s <= 0:
        raise ValueError(f"--dist-timeout must be positive seconds, got {timeout_s}")
    _fault_only_on_chosen_rank(rank)
    timeout = timedelta(seconds=timeout_s)
    if world > 1 and not td.is_initialized():
        td.init_process_group("gloo", store=_attempt_store(rank, world, timeout), rank=rank,
                              world_size=world, timeout=timeout)
    elif world > 1:
        check_group_backend(device, str(td.get_backend()))
    grad_group = td.new_group(backend="nccl", timeout=timeout) if cuda and world > 1 else None
    return Dist(rank, world, timeout_s, device=device, bucket_bytes=bucket_bytes, grad_group=grad_group)


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
