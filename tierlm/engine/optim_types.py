"""The optimizer's small types: its configuration, what it is built from and its step result, the
form of a shard's state, one shard's unit of work with its buffers (`tierlm.engine.optimizer` runs
the pipeline over them), and the bytes its state and its shards in flight take."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from . import state_quant as SQ
from ..storage import HostBufferPool, TensorStore
from ..storage.aligned import round_up
from ..storage.layout import ParamInfo, nbytes


@dataclass
class AdamWConfig:
    lr: float = 1e-5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None
    impl: str = "fused"  # fused | foreach | single: which torch AdamW kernel (results match that kernel)

    def kernel_flags(self) -> dict:
        return {"fused": dict(fused=True, foreach=False), "foreach": dict(fused=False, foreach=True),
                "single": dict(fused=False, foreach=False)}[self.impl]


@dataclass
class StepResult:
    grad_norm: float
    clip_coef: float  # 1.0 when not clipped
    redone: bool
    finite: bool
    clip_path: str = "speculate"  # speculate (update beside backward, redo if it clips) | hold (update after the norm)
    experts: dict | None = None  # stacked experts' state I/O of the step (Engine.finish; expert_io.py)


@dataclass(frozen=True)
class OptimizerDeps:
    """What the optimizer works through. store: where the state lives; pool: RAM for the shards in
    flight; state_cache: RAM for shards' states kept resident between steps (their reads are
    skipped, their writes still happen: every step stays durable), or None; dist: a data-parallel
    rank (tierlm.dist) or None; on_event(kind, what, t0, t1, n): the timeline's record of an update
    or a wait; on_new_weights(name, shard, tensor): the new working weights of a shard, before they
    are written (the weight window keeps them for the next forward)."""
    store: TensorStore
    pool: HostBufferPool
    state_cache: HostBufferPool | None = None
    dist: object | None = None
    on_event: Callable | None = None
    on_new_weights: Callable | None = None
    on_unchanged: Callable | None = None  # (name, shard): a fresh expert shard left alone keeps its weights


@dataclass(frozen=True)
class OutOfCoreOptions:
    """How the optimizer holds and paces its state. weight_dtype: the working weights' dtype, or
    None when they are the fp32 master (full fp32); optim_states: how m and v are stored (fp32 |
    bf16 | int8, state_quant); lookahead: shards read ahead of the one being updated;
    max_pending_grad_bytes: gradient bytes backward may hand over before it waits for the optimizer;
    fp32_weights: parameters whose working weights are fp32 whatever weight_dtype is (what the family
    keeps in fp32 in a bf16 model: hf.structure.kept_fp32)."""
    weight_dtype: torch.dtype | None = None
    optim_states: str = "fp32"
    lookahead: int = 4
    max_pending_grad_bytes: int = 1 << 62
    clip_path: str = "auto"  # auto | speculate | hold: how an exact clip learns its factor (optimizer.clip_path)
    fp32_weights: frozenset[str] = frozenset()


EARLY = "\x00early"  # the arrival of a parameter's shards whose gradient is final before the rest


class OptimizerError(RuntimeError):
    pass


@dataclass(frozen=True)
class StateFormat:
    """The form of a shard's state in its buffers: fp32 master, m and v (and their stored form in a
    compressed mode: tags qm, qv), the working weights (w) in weight_dtype (fp32 for the parameters
    in fp32_weights), fp32 gradients (g)."""
    weight_dtype: torch.dtype | None
    states: str = "fp32"
    fp32_weights: frozenset[str] = frozenset()

    def wdtype(self, name: str | None) -> torch.dtype | None:
        """The dtype of the working weights (w) of parameter `name`."""
        return torch.float32 if self.weight_dtype is not None and name in self.fp32_weights else self.weight_dtype

    @property
    def quant(self) -> bool:
        return self.states != "fp32"

    @property
    def state_tags(self) -> tuple[str, ...]:
        """The tags whose buffers hold the state between steps: fp32 m/v, or their stored form."""
        return ("master", "qm", "qv") if self.quant else ("master", "m", "v")

    def size(self, tag: str, n: int, name: str | None = None) -> int:
        """Bytes of the buffer `tag` of an n-element shard (of parameter `name`)."""
        if tag == "w":
            return nbytes(self.wdtype(name), n)
        if tag in ("qm", "qv"):
            return SQ.stored_nbytes(self.states, n)
        return nbytes(torch.float32, n)

    def view(self, bufs: dict, tag: str, n: int) -> torch.Tensor:
        """A buffer as the tensor it holds: fp32, or a moment's stored form."""
        if tag in ("qm", "qv"):
            dt, numel = SQ.stored_spec(self.states, n)
            return bufs[tag].view(dt, (numel,))
        return bufs[tag].view(torch.float32, (n,))

    def check_shards(self, infos: dict[str, ParamInfo]) -> None:
        """A compressed mode quantises in blocks: a block straddling two shards would be quantised
        differently from the whole tensor's."""
        bad = [f"{n}.{k}" for n, i in infos.items() for k, (a, _) in enumerate(i.shards) if a % SQ.BLOCK]
        if self.quant and bad:
            raise OptimizerError(f"--optim-states {self.states} needs shards of a multiple of {SQ.BLOCK} "
                                 f"elements; {bad[0]} starts off a block boundary")


class ShardItem:
    """One (parameter, shard) of work, with its buffers once prepared."""

    __slots__ = ("name", "shard", "a", "b", "bufs", "reads", "keep", "cached", "src", "last", "_left", "_lock",
                 "fresh", "lazy", "acc_zero")

    def __init__(self, name: str, shard: int, a: int, b: int):
        self.name, self.shard, self.a, self.b = name, shard, a, b
        self.src, self.last = name, False  # the gradient it reads (_grads key); the arrival's last shard
        self.bufs: dict = {}
        self.reads: list[Future] = []
        self.keep: set[str] = set()  # buffers from the state cache: they stay resident after the step
        self.cached: set[str] = set()  # of those, the ones holding the committed state (a cache hit)
        self.fresh = False     # a fresh expert shard: its moments are zero, with no file (expert_state.py)
        self.lazy = False      # ... not prepared until its gradient is known (it may be left alone)
        self.acc_zero = False  # ... whose accumulated gradient is known zero (not read)
        self._lock = threading.Lock()

    def release(self) -> None:
        for buf in self.bufs.values():
            buf.release()
        self.bufs = {}

    def release_after(self, writes: list[Future], written: set[str]) -> None:
        """Give the buffers back when the last write from them finishes (on the I/O thread, so a
        worker blocked on a full pool is woken without having to reap). Those no write reads from
        (a gradient's fp32 copy, decoded moments) go back now: held until the writes landed, they
        paced the optimizer by the drive's writes with the pool full of buffers nothing needed."""
        for tag in [t for t in self.bufs if t not in written]:
            self.bufs.pop(tag).release()
        if not writes:
            self.release()
            return
        self._left = len(writes)

        def one_done(_):
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self.release()
        for f in writes:
            f.add_done_callback(one_done)


def total_state_bytes(infos: dict[str, ParamInfo], weight_dtype: torch.dtype | None,
                      optim_states: str = "fp32", fp32_weights: frozenset[str] = frozenset()) -> int:
    """Bytes on NVMe per slot: fp32 master, m and v as stored, plus working weights when not fp32."""
    fmt = StateFormat(weight_dtype, optim_states, fp32_weights)
    return sum(4 * i.shard_numel(k) + 2 * SQ.stored_nbytes(optim_states, i.shard_numel(k))
               + (fmt.size("w", i.shard_numel(k), n) if weight_dtype is not None else 0)
               for n, i in infos.items() for k in range(len(i.shards)))


def shard_buffer_bytes(shard: int, weight_dtype: torch.dtype | None, optim_states: str = "fp32") -> int:
    """The optimizer buffers of one shard in flight, each page-aligned as the pool hands it out:
    fp32 master, m, v and gradient, the working weights, in a compressed mode the stored m and v
    beside their fp32 working copies, and in a clipped step's update from the held gradients
    (`redo`, `apply`) the gradient as saved in the working dtype beside its fp32 copy. Without that
    last one a pool of one shard's buffers waited forever for it (the README's demo, at step 2)."""
    w = round_up(nbytes(weight_dtype, shard)) if weight_dtype is not None else 0
    saved = w if weight_dtype not in (None, torch.float32) else 0  # an fp32 gradient is read into g
    extra = 2 * round_up(SQ.stored_nbytes(optim_states, shard)) if optim_states != "fp32" else 0
    return 4 * round_up(nbytes(torch.float32, shard)) + w + saved + extra
