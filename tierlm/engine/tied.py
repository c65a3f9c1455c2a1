"""A tied head's gradient, taken away from autograd: summed in place, and its untouched rows early.

A weight shared by the embedding and the head (qwen2) gets two gradients: the head's, at the start
of backward, and the embedding's, at its very end. Left to autograd, the two are summed out of
place, a third tensor of the weight's size at the step's peak (measured on torch 2.13's CPU path:
Qwen2.5-0.5B in fp32 under --cpu-mem 4GiB peaked 4.13 GiB, the third 545 MB tensor over the
budget). So the head never hands its gradient to autograd: the unchunked head reads the weight
detached and `_WeightGrad` makes its gradient (in a buffer kept across steps, on the CPU), the chunked
loss (head_loss) hands it over through the head's `tierlm_head_grad`, and the
engine adds the head's gradient into the embedding's, in place (`add_to`), before the optimizer
gets it. Same bits: head + embedding is one IEEE addition in either order.

Early rows. A row the batch's tokens do not look up gets nothing from the embedding, so its
gradient is the head's alone, complete when the head's backward ends. The shards holding no
looked-up row go to the optimizer then (OutOfCoreAdamW.grad_ready's `shards`), beside the layers'
backward, rather than after the step's last op (136M parameters of optimizer I/O for Qwen2.5-0.5B);
the full gradient later updates the rest and gives the norm. Only with one process on the CPU and
no gradient accumulation (`early`): with several micro-batches or ranks the rows looked up are not
known when the head's gradient is; on a GPU the gradient would cross PCIe twice.
"""
from __future__ import annotations

import torch
from torch import nn


def untouched_shards(shards, width: int, ids: torch.Tensor) -> list[int]:
    """The shards (flat element ranges of a [rows, width] weight) holding none of the rows `ids`."""
    rows = torch.unique(ids.reshape(-1).cpu())
    out = []
    for k, (a, b) in enumerate(shards):
        i = int(torch.searchsorted(rows, a // width))
        if i == len(rows) or int(rows[i]) > (b - 1) // width:
            out.append(k)
    return out


class _WeightGrad(torch.autograd.Function):
    """The head's output, unchanged (the head read its weight detached, so autograd makes only the
    input's gradient). Backward makes the weight's gradient as autograd's linear does, one product of
    the output's gradient and the input (the same bits), into `taker`'s buffer, and hands it over."""

    @staticmethod
    def forward(ctx, out, x, taker):
        ctx.taker = taker
        ctx.save_for_backward(x)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        ctx.taker(torch.mm(g2.t(), x2, out=ctx.taker.buffer(x2.dtype)))
        return grad, None, None


def _refs(t: torch.Tensor) -> int:
    """Tensors over `t`'s memory (it and its views; a view's view counts too)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class TiedHeadGrad:
    def __init__(self, engine, name: str, head: nn.Linear, early: bool):
        self.engine, self.name, self.early = engine, name, early
        self.param = head.weight
        self.ids: torch.Tensor | None = None  # the micro-batch's input ids (Engine.forward)
        self.head_grad: torch.Tensor | None = None  # taken over, until the embedding's arrives
        self._reading = False  # the head runs with its weight detached (between the two hooks)
        # The unchunked head's gradient, kept from step to step on the CPU: made fresh, it was 272 MB
        # of new pages for Qwen2.5-0.5B, zeroed by the kernel while the head's backward waited
        # (docs/benchmarks.md at a2b1c1e, "The step is the drive's time for its requests"). On a GPU the caching
        # allocator reuses the memory already.
        self.keep = not engine.on_gpu
        self._buf: torch.Tensor | None = None
        self._buf_refs = 0
        self.fresh = 0  # buffers made (tests)

    @classmethod
    def attach(cls, engine) -> "TiedHeadGrad | None":
        head = engine.model.get_output_embeddings()
        tied = [n for b in engine.blocks if b.kind == "head" for n in b.uses if n not in b.owns]
        if (len(tied) != 1 or not isinstance(head, nn.Linear) or engine.params[tied[0]] is not head.weight
                or len(engine.infos[tied[0]].shape) != 2):
            return None
        early = (engine.cfg.early_tied and not engine.on_gpu and engine.dist is None
                 and engine.cfg.grad_accum == 1)
        out = cls(engine, tied[0], head, early)
        head.tierlm_head_grad = out  # the chunked loss's route (head_loss)
        head.register_forward_pre_hook(out._read_through)
        head.register_forward_hook(out._restore)
        return out

    def _read_through(self, head: nn.Module, args) -> None:
        if torch.is_grad_enabled():  # (the chunked loss calls the head with autograd off)
            head._parameters["weight"] = self.param.detach()
            self._reading = True

    def _restore(self, head: nn.Module, args, out):
        head._parameters["weight"] = self.param
        if self._reading:
            self._reading = False
            return _WeightGrad.apply(out, args[0], self)
        return None

    def buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """Memory for the head's gradient: the kept buffer when nothing holds it any more (the
        optimizer let go of last step's, its saved-gradient writes landed), else new memory."""
        buf = self._buf
        if buf is None or buf.dtype != dtype or _refs(buf) > self._buf_refs:
            buf = torch.empty(self.param.shape, dtype=dtype, device=self.param.device)
            self.fresh += 1
            if self.keep:
                self._buf, self._buf_refs = buf, _refs(buf)
        return buf.view_as(buf)  # what is handed out is a view: while one lives, _refs(buf) counts it

    def __call__(self, grad: torch.Tensor) -> bool:
        """The head's gradient of the weight, at the start of backward; always taken over."""
        if self.head_grad is not None:
            raise RuntimeError(f"the head ran twice before one backward: its gradients of the tied "
                               f"{self.name} cannot be taken over; run forward, backward, step in turn")
        self.head_grad = grad
        opt = self.engine.optimizer
        if self.early and self.ids is not None and opt._run is not None:
            info = self.engine.infos[self.name]
            early = untouched_shards(info.shards, info.shape[1], self.ids)
            if early:
                opt.grad_ready(self.name, grad, shards=early)
        return True

    def add_to(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The embedding's gradient of `name` plus the head's taken over, in the embedding's memory."""
        head = self.head_grad
        if name != self.name or head is None:
            return grad
        self.head_grad = None
        return grad.add_(head)

    def add_rows(self, rows: torch.Tensor, sums: torch.Tensor) -> bool:
        """The embedding's gradient as the sums of the rows it looked up (next_rows' lookup),
        added into the head's in place; False if there is no head's gradient to add them to. The
        sum is then handed over after backward (`leftover`), the embedding's gradient in full."""
        if self.head_grad is None or self.head_grad.dtype != sums.dtype:
            return False
        self.head_grad.index_add_(0, rows.to(self.head_grad.device), sums)
        return True

    def leftover(self) -> torch.Tensor | None:
        """After backward: the head's gradient if the embedding gave none to add it to."""
        head, self.head_grad = self.head_grad, None
        return head
