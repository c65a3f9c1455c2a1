"""The optimizer's small types: its configuration and step result, one shard's unit of work with
its buffers (`tierlm.engine.optimizer` runs the pipeline over them), and the bytes its state and
its shards in flight take."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from . import state_quant as SQ
from ..storage.layout import ParamInfo


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


EARLY = "\x00early"  # the arrival of a parameter's shards whose gradient is final before the rest


class OptimizerError(RuntimeError):
    pass


class ShardItem:
    """One (parameter, shard) of work, with its buffers once prepared."""

    __slots__ = ("name", "shard", "a", "b", "bufs", "reads", "keep", "cached", "src", "last", "_left", "_lock")

    def __init__(self, name: str, shard: int, a: int, b: int):
        self.name, self.shard, self.a, self.b = name, shard, a, b
        self.src, self.last = name, False  # the gradient it reads (_grads key); the arrival's last shard
        self.bufs: dict = {}
        self.reads: list[Future] = []
        self.keep: set[str] = set()  # buffers from the state cache: they stay resident after the step
        self.cached: set[str] = set()  # of those, the ones holding the committed state (a cache hit)
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
                      optim_states: str = "fp32") -> int:
    """Bytes on NVMe per slot: fp32 master, m and v as stored, plus working weights when not fp32."""
    w = torch.empty((), dtype=weight_dtype).element_size() if weight_dtype is not None else 0
    return sum(4 * i.numel + 2 * SQ.stored_nbytes(optim_states, i.shard_numel(k)) + w * i.numel
               for i in infos.values() for k in range(len(i.shards)))


def shard_buffer_bytes(shard: int, weight_dtype: torch.dtype | None, optim_states: str = "fp32") -> int:
    """The optimizer buffers of one shard in flight: fp32 master, m, v and gradient, the working
    weights, and in a compressed mode the stored m and v beside their fp32 working copies."""
    w = torch.empty((), dtype=weight_dtype).element_size() if weight_dtype is not None else 0
    extra = 2 * SQ.stored_nbytes(optim_states, shard) if optim_states != "fp32" else 0
    return shard * (16 + w) + extra
