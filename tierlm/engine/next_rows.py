"""The next forward's embedding rows, copied out of this step's update instead of read back.

A forward looks up a few hundred rows of the embedding, but loading the embedding block reads the
whole matrix, before layer 0 can run: Qwen2.5-0.5B's is 272 MB of bf16 (tied to the head, so the
head reads it again at the end of the forward). When the trainer knows the next batch
(`Engine.expect`), the rows it looks up are copied out of each embedding shard's new working
weights as the optimizer hands them over (the values the store then holds, a clip redo's included),
and that forward's lookup takes them: no read, and the same bits, since a lookup is a gather and its
backward is the dense scatter autograd runs for `nn.Embedding` (`aten.embedding_dense_backward`).

A held step's update (exact clipping, `--clip-path hold`) runs after its commit, beside the next
forward and in that forward's order, so the embedding's shards are the first it renews: the rows
are gathered from those offers, and the lookup waits for the last one (`commit(deferred=True)`)
instead of for the whole embedding to be written and read back. On the 271M llama at 4x512 tokens
(--cpu-mem 2GiB) that read-back was 0.3 s of the step's 0.45 s start, and the compute thread
waiting in the window made layer 0's renewals miss it, so layer 0 was read back too.

Anything else (other ids, a shard not updated, a dropped step, a forward before the commit) reads
the embedding as before.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from ..storage.layout import ParamInfo


class _Lookup(torch.autograd.Function):
    """`F.embedding(ids, weight)` from the looked-up rows alone; the weight's gradient as
    nn.Embedding's backward computes it.

    With a `taker` (a tied head's gradient, TiedHeadGrad.add_rows) the gradient never becomes a
    weight-sized tensor: the looked-up rows' sums (the same dense backward over the rows alone, the
    same order of summation) are added into the head's gradient in place, one IEEE addition a row
    as `add_to` does. For Qwen2.5-0.5B that is a 272 MB zeroed tensor and a 272 MB sum fewer at the
    end of every backward (0.1 s alone, 0.4 s beside the optimizer at 1x32 tokens)."""

    @staticmethod
    def forward(ctx, weight, ids, rows, inverse, padding_idx, scale_grad_by_freq, uniq, taker):
        ctx.save_for_backward(ids, inverse, uniq)
        ctx.num, ctx.pad, ctx.scale, ctx.taker = weight.shape[0], padding_idx, scale_grad_by_freq, taker
        return rows.index_select(0, inverse.reshape(-1)).view(*ids.shape, rows.shape[1])

    @staticmethod
    def backward(ctx, grad):
        ids, inverse, uniq = ctx.saved_tensors
        none = (None,) * 7
        if ctx.taker is not None:
            hit = (uniq == ctx.pad).nonzero()
            pad = int(hit[0, 0]) if ctx.pad >= 0 and len(hit) else -1
            sums = torch.ops.aten.embedding_dense_backward(grad, inverse.view(ids.shape), len(uniq), pad, ctx.scale)
            if ctx.taker.add_rows(uniq, sums):
                return (None,) + none
        g = torch.ops.aten.embedding_dense_backward(grad, ids, ctx.num, ctx.pad, ctx.scale)
        return (g,) + none


class NextRows:
    """The rows of one embedding weight that the expected next forward looks up."""

    def __init__(self, name: str, info: ParamInfo, dtype: torch.dtype):
        self.name, self.info, self.dtype = name, info, dtype
        self.width = info.shape[1]
        self.used = 0  # forwards that took their rows from here (tests, stats)
        # offer() runs on the optimizer's thread, take() on the compute thread: with a deferred
        # update the lookup waits here for the offers still to come
        self._cv = threading.Condition()
        self._clear()

    @staticmethod
    def usable(mod: nn.Module) -> bool:
        """Only a plain lookup: max_norm renormalises the weight in place, sparse gradients differ."""
        return isinstance(mod, nn.Embedding) and mod.max_norm is None and not mod.sparse

    def _clear(self) -> None:
        self.ids: torch.Tensor | None = None
        self.rows = self.elems = self.inverse = self.uniq = None
        self.seen: set[int] = set()
        self.committed = False
        self.awaiting = False  # committed before its update (deferred): offers still to come

    def expect(self, ids: torch.Tensor) -> None:
        """The next forward's input ids; call before this step's backward (shards updated before
        the call are missed, and then the next forward reads the embedding as usual)."""
        self._clear()
        ids = ids.detach().to("cpu", torch.long)
        uniq, inverse = torch.unique(ids, return_inverse=True)
        if len(uniq) and (int(uniq[0]) < 0 or int(uniq[-1]) >= self.info.shape[0]):
            return  # the forward itself will name the bad id
        self.ids, self.inverse, self.uniq = ids.clone(), inverse, uniq
        # rows ascending, each row's elements contiguous: the flat elements in ascending order, so
        # those of a shard [a, b) are one slice
        self.elems = (uniq[:, None] * self.width + torch.arange(self.width)).reshape(-1)
        self.rows = torch.empty(len(uniq), self.width, dtype=self.dtype)

    def offer(self, shard: int, values: torch.Tensor) -> None:
        """A shard's new working weights (the optimizer's thread, before they are written)."""
        with self._cv:
            if self.ids is None or (self.committed and not self.awaiting):
                return
            a, b = self.info.shards[shard]
            lo, hi = (int(torch.searchsorted(self.elems, x)) for x in (a, b))
            if hi > lo:
                self.rows.view(-1)[lo:hi] = values.reshape(-1).index_select(0, self.elems[lo:hi] - a)
            self.seen.add(shard)
            if self.awaiting and len(self.seen) == len(self.info.shards):
                self.awaiting = False
                self._cv.notify_all()

    def update_starts(self) -> None:
        """A held step's deferred update is about to offer its shards. Its thread may offer them
        before the main thread's commit() says the update is deferred: the rows expected for it
        take its offers from now on (without this, offers in between were dropped, and under a
        busy CPU the next forward read the whole embedding)."""
        with self._cv:
            if self.ids is not None and not self.committed:
                self.awaiting = len(self.seen) < len(self.info.shards)

    def commit(self, applied: bool, deferred: bool = False) -> None:
        """The step is the state (applied) or was dropped: only a fully renewed copy is kept.
        deferred: the step's update runs from now on, beside the next forward; its offers complete
        the rows (a lookup waits for them), or `end_deferred` gives them up."""
        with self._cv:
            if self.ids is not None and applied and deferred:
                self.committed = True
                self.awaiting = len(self.seen) < len(self.info.shards)
            elif self.ids is not None and applied and len(self.seen) == len(self.info.shards):
                self.committed = True
            else:
                self._clear()

    def end_deferred(self) -> None:
        """The deferred update ended (or failed): rows it did not complete are given up, and a
        lookup waiting for them reads the embedding instead (which raises the update's failure)."""
        with self._cv:
            if self.awaiting:
                self._clear()
            self._cv.notify_all()

    def pending(self) -> bool:
        """Rows wait for the next forward, or are being gathered for it: the engine then skips
        reading the embedding ahead. From the expect() on, not only from the commit: backward's
        read-ahead past layer 0 read the whole embedding (272 MB for Qwen2.5-0.5B) every step for a
        forward that took its rows from here. Should the rows be dropped (a step not applied), that
        forward reads the embedding when it needs it."""
        return self.ids is not None

    def waits(self) -> bool:
        """Whether a lookup would wait for a deferred update's offers."""
        return self.awaiting

    def take(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(rows, inverse, the ids' distinct values) if `ids` are the ids expected (waiting for a
        deferred update to offer the rest); either way the copy is used up."""
        with self._cv:
            ok = (self.committed and ids.shape == self.ids.shape
                  and torch.equal(ids.detach().cpu(), self.ids))
            while ok and self.awaiting:
                self._cv.wait()
            ok = ok and self.committed
            out = (self.rows, self.inverse.to(ids.device), self.uniq.to(ids.device)) if ok else None
            self._clear()
        if ok:
            self.used += 1
        return out

    def lookup(self, mod: nn.Embedding, weight: torch.Tensor, ids: torch.Tensor, rows, inverse, uniq,
               taker=None) -> torch.Tensor:
        """taker: where the rows' gradient goes instead of a weight-sized one (see _Lookup)."""
        pad = -1 if mod.padding_idx is None else mod.padding_idx
        return _Lookup.apply(weight, ids, rows.to(ids.device), inverse, pad, mod.scale_grad_by_freq, uniq, taker)
