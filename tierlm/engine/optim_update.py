"""One shard's AdamW update, exactly `torch.optim.AdamW`'s: its own functional kernel
(`torch.optim.adamw.adamw`, fused/foreach/single as configured) on the same fp32 master, m and v,
with its bias correction and decoupled weight decay. The kernel is elementwise, so a shard gives
the bits the whole tensor would. The gradient comes as torch would hold it: accumulated over the
micro-batches in fp32 (grad += new), or scaled by the clip factor (what clip_grad_norm_ does).

With `optim_states` bf16 or int8 the moments are decoded from their stored form to fp32 buffers,
the same kernel runs, and the new moments are encoded again before they are written: the result
is torch's AdamW with the same encode/decode around each step. The master weights stay fp32.
"""
from __future__ import annotations

from concurrent.futures import Future

import torch
from torch.optim.adamw import adamw

from ..storage import TensorStore
from ..storage.layout import key
from . import state_quant as SQ
from .optim_types import AdamWConfig, ShardItem, StateFormat


def adamw_shard(master: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                lr: float, cfg: AdamWConfig) -> None:
    """torch's AdamW step on one shard's fp32 tensors, in place; `step`: the updates before it."""
    step_t = torch.tensor(float(step))
    adamw([master], [g], [m], [v], [], [step_t], lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
          weight_decay=cfg.weight_decay, eps=cfg.eps, amsgrad=False, maximize=False, **cfg.kernel_flags())


def fp32_grad(g: torch.Tensor, it: ShardItem, micro: int) -> torch.Tensor:
    """The fp32 gradient of a shard (`g`: its slice of the handed-over gradient), accumulated over
    the micro-batches so far in the buffer `g` of `it` (read from the accumulator)."""
    if micro > 0:
        acc = it.bufs["g"].view(torch.float32, (it.b - it.a,))
        acc.add_(g)  # what autograd's accumulation does: grad += new
        return acc
    if g.dtype != torch.float32:
        out = it.bufs["g"].view(torch.float32, (it.b - it.a,))
        out.copy_(g)
        return out
    return g


def clipped_grad(g: torch.Tensor, saved: torch.Tensor | None, clip: torch.Tensor | None) -> torch.Tensor:
    """A saved gradient (upcast exactly from `saved`, its low-precision form, when there is one)
    times the clip factor, in `g`; None: the step does not clip (a held step's update)."""
    if saved is not None:
        g.copy_(saved)
    if clip is not None:
        g.mul_(clip)  # what clip_grad_norm_ does to each gradient
    return g


class ShardUpdate:
    """A prepared shard's update and the writes of its new state to the slot `new`: fp32 master,
    m and v as stored, and the working weights when they are not the master."""

    def __init__(self, store: TensorStore, cfg: AdamWConfig, fmt: StateFormat):
        self.store, self.cfg, self.fmt = store, cfg, fmt

    def apply(self, it: ShardItem, g: torch.Tensor, step: int, lr: float, new: int,
              write_state: bool = True) -> tuple[list[Future], set[str], torch.Tensor]:
        """The writes, the buffers they read from, and the new working weights. write_state False:
        the new master and moments stay in RAM only (the state cache keeps them until the commit
        writes them); the working weights are written either way (the window reads them back)."""
        n = it.b - it.a
        view = lambda tag: self.fmt.view(it.bufs, tag, n)
        master, m, v = view("master"), view("m"), view("v")
        if self.fmt.quant:
            if step > 0 and not it.fresh:
                SQ.decode(self.fmt.states, view("qm"), m, signed=True)
                SQ.decode(self.fmt.states, view("qv"), v, signed=False)
            else:
                m.zero_()
                v.zero_()
        adamw_shard(master, g, m, v, step, lr, self.cfg)
        if self.fmt.quant:
            SQ.encode(self.fmt.states, m, view("qm"), signed=True)
            SQ.encode(self.fmt.states, v, view("qv"), signed=False)
            m, v = view("qm"), view("qv")
        writes = []
        if write_state or self.fmt.weight_dtype is None:  # (fp32: the master is the working weights)
            writes.append(self.store.write(key("master", it.name, it.shard, new), master))
        if write_state:
            writes += [self.store.write(key("m", it.name, it.shard, new), m),
                       self.store.write(key("v", it.name, it.shard, new), v)]
        w = master
        if self.fmt.weight_dtype is not None:
            w = it.bufs["w"].view(self.fmt.wdtype(it.name), (n,))
            w.copy_(master)  # the same rounding as `param.data.copy_(master)`
            writes.append(self.store.write(key("w", it.name, it.shard, new), w))
        written = {"master", "w"} | ({"qm", "qv"} if self.fmt.quant else {"m", "v"})
        return writes, written, w
