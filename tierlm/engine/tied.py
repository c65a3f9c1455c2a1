"""A tied head's rows that the batch does not look up, updated at the start of backward.

A weight shared by the embedding and the head (qwen2) has its whole gradient only after the
embedding's backward, the step's very last: its optimizer I/O (136M parameters for Qwen2.5-0.5B)
then followed the whole backward. A row the batch's tokens do not look up gets nothing from the
embedding, so its gradient is the head's alone, complete when the chunked head's backward ends
(head_loss hands it over through the head module's `tierlm_head_grad`). The shards holding no
looked-up row go to the optimizer then; the full gradient later updates the rest and gives the
norm (OutOfCoreAdamW.grad_ready's `shards`). Same bits as waiting.

One process on the CPU, no gradient accumulation: with several micro-batches or ranks the rows
looked up are not known when the head's gradient is; on a GPU the gradient would cross PCIe twice.
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


class EarlyTied:
    def __init__(self, engine, name: str):
        self.engine, self.name = engine, name
        self.ids: torch.Tensor | None = None  # the micro-batch's input ids (Engine.forward)
        self.head_grad: torch.Tensor | None = None  # taken over from autograd, until the embedding's

    @classmethod
    def attach(cls, engine) -> "EarlyTied | None":
        head = engine.model.get_output_embeddings()
        tied = [n for b in engine.blocks if b.kind == "head" for n in b.uses if n not in b.owns]
        if (not engine.cfg.early_tied or len(tied) != 1 or engine.on_gpu or engine.dist is not None
                or engine.cfg.grad_accum != 1 or not isinstance(head, nn.Linear)
                or engine.params[tied[0]] is not head.weight or len(engine.infos[tied[0]].shape) != 2):
            return None
        out = cls(engine, tied[0])
        head.tierlm_head_grad = out
        return out

    def __call__(self, grad: torch.Tensor) -> bool:
        """The head's gradient of the tied weight, at the start of backward. Returns True when it
        takes the gradient over: autograd then gets none from the head, and `add_to` adds it to
        the embedding's, in place. Left to autograd, the sum is out of place (a third tensor of the
        weight's size) whenever another reference to the head's part is alive, as the optimizer's
        is while it still reads it in an I/O-bound step."""
        opt = self.engine.optimizer
        if self.ids is None or opt._run is None:
            return False
        info = self.engine.infos[self.name]
        early = untouched_shards(info.shards, info.shape[1], self.ids)
        self.head_grad = grad
        if early:
            opt.grad_ready(self.name, grad, shards=early)
        return True

    def add_to(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The embedding's gradient of `name` plus the head's taken over (the same bits as
        autograd's sum: head + embedding, in either order, is one IEEE addition)."""
        head = self.head_grad
        if name != self.name or head is None:
            return grad
        self.head_grad = None
        return grad.add_(head)
