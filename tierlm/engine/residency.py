"""Which blocks' working weights are resident, and when: a block's weights are loaded from the window
before it computes and dropped after (the head's held through the loss), the window reads ahead
of the compute, and each block's compute and waits go on the timeline. A mixin of Engine: the
forward and backward hooks of every block call in here."""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch import nn

from ..faults import fault
from ..hf.structure import module_param_slots
from .device import synchronize
from .next_rows import NextRows


class BlockResidency:
    def _hook_embed_and_head(self) -> None:
        by_kind = {b.kind: b for b in self.blocks if b.kind != "layer"}
        slots = module_param_slots(self.model)
        embed = by_kind["embed"]
        # the embed block's weights outside embeddings (weights_before_layers), held through the step
        self.early = [n for n in embed.uses if not any(isinstance(m, nn.Embedding) for m, _ in slots[n])]
        for kind in ("embed", "head"):
            blk = by_kind[kind]
            # Tied weights sit in an Embedding and in lm_head: each block hooks its own kind.
            mods = {id(m): (m, attr) for n in blk.uses for m, attr in slots[n]
                    if isinstance(m, nn.Embedding) == (kind == "embed")}
            for mod, attr in mods.values():
                names = [self._canon(mod, a) for a in mod._parameters if mod._parameters[a] is not None]
                if kind == "embed":
                    if len(mods) == 1 and len(names) == 1 and names == [n for n in blk.uses if n not in self.early] \
                            and NextRows.usable(mod):
                        self.next_rows = NextRows(names[0], self.infos[names[0]], self.wdtype(names[0]))
                    mod.register_forward_pre_hook(lambda m, a, ns=names: self._embed_in(m, a, ns))
                    mod.register_forward_hook(lambda m, a, o, ns=names: self._embed_out(m, a, ns))
                else:
                    mod.register_forward_pre_hook(lambda m, a, ns=names: self._hold_head(ns))
        early_mods = {id(m): m for n in self.early for m, _ in slots[n]}
        for mod in early_mods.values():
            names = [self._canon(mod, a) for a in mod._parameters if mod._parameters[a] is not None]
            mod.register_forward_pre_hook(lambda m, a, ns=names: self._hold_early(ns))

    def _embed_in(self, mod: nn.Module, args, names) -> None:
        nr = self.next_rows
        got = None
        if nr is not None and names == [nr.name] and args:
            t0 = time.perf_counter()
            with self.timeline.span("wait", "embedding rows") if nr.waits() else nullcontext():
                got = nr.take(args[0])  # (a held step's update still offering them: waits)
            self.acts.waited(time.perf_counter() - t0)
        if got is not None:
            mod._tierlm_rows = got  # the lookup takes the expected rows: the weight stays unread
        else:
            self._load(names)

    def _embed_out(self, mod: nn.Module, args, names):
        got = mod.__dict__.pop("_tierlm_rows", None)
        if got is None:
            self._unload(names)
            return None
        # replaces the output F.embedding computed from the unloaded (placeholder) weight
        tied = self.tied_grad if self.tied_grad is not None and self.tied_grad.name == self.next_rows.name else None
        return self.next_rows.lookup(mod, self.params[self.next_rows.name], args[0], *got, taker=tied)

    def expect(self, input_ids: torch.Tensor) -> None:
        """The input ids of the forward after this step, when known before its (last) backward: the
        embedding rows they look up are kept from this step's update, and that forward reads no
        embedding (next_rows). Any other forward reads it as before."""
        if self.next_rows is not None and self.cfg.next_rows:
            self.next_rows.expect(input_ids)

    def _new_weights(self, name: str, shard: int, values: torch.Tensor) -> None:
        self.window.offer(name, shard, values)
        # (a deferred update runs after its step committed, beside the next forward: its offers
        # complete the rows that forward waits for; an expect() for a later forward, made while
        # it still runs, takes none of its offers)
        nr = self.next_rows
        if nr is not None and name == nr.name and (not self.optimizer.applying or nr.waits()):
            nr.offer(shard, values)

    def _canon(self, mod: nn.Module, attr: str) -> str:
        p = mod._parameters[attr]
        return next(n for n, q in self.params.items() if q is p)

    # ---- weights in and out of the modules ---------------------------------------------
    def _load(self, names) -> None:
        t0 = time.perf_counter()
        with self.timeline.span("wait", "weights"):
            if self.uploads is None:
                tensors = self.window.acquire(names)
            else:
                tensors = {n: self.uploads.get(n) for n in names}
        self.acts.waited(time.perf_counter() - t0)
        for n, t in tensors.items():
            self._pins[n] = self._pins.get(n, 0) + 1
            if self._pins[n] == 1:
                p = self.params[n]
                p.data = t
                self.hooks.track(p)

    def _unload(self, names) -> None:
        for n in names:
            self._pins[n] -= 1
            if self._pins[n] == 0:  # a tied weight stays while another block still uses it
                p = self.params[n]
                self.hooks.untrack(p)
                p.data = self._placeholder(n, p.shape)
                if self.uploads is not None:
                    self.uploads.drop(n)
        if self.uploads is None:
            self.window.release(names)

    def _placeholder(self, name: str, shape) -> torch.Tensor:
        """An unloaded parameter: the right shape and dtype (autograd checks them when accumulating
        a gradient) over a single element of memory."""
        return torch.zeros(1, dtype=self.wdtype(name), device=self.device).expand(shape)

    def _hold_head(self, names) -> None:
        self.heap.check()
        new = [n for n in names if n not in self._held_head]
        if new:
            self._load(new)
            self._held_head.extend(new)
        if self._t_head is None:
            self._t_head = time.perf_counter()  # the head and loss compute from here (timeline)

    def _hold_early(self, names) -> None:
        """Weights used before the first layer: loaded at their first use in a forward and held
        until its backward is over, which needs them last (drop_early)."""
        new = [n for n in names if n not in self._held_early]
        if new:
            self._load(new)
            self._held_early.extend(new)

    def _drop_early(self) -> None:
        if self._held_early:
            held, self._held_early = self._held_early, []
            self._unload(held)

    def _head_computed(self, phase: str, t0: float | None) -> None:
        if t0 is not None:
            synchronize(self.device)
            self.timeline.event("compute", f"{phase} head and loss", t0, time.perf_counter())

    def _drop_head(self) -> None:
        if self._held_head:
            held, self._held_head = self._held_head, []
            self._unload(held)

    def _upload_ahead(self, j: int) -> None:
        """The next layer's weights to the GPU while this one computes, if its read has landed
        (only layers: the embedding has no backward use, the head is held by its own hook)."""
        if self.uploads is not None and 0 <= j < len(self.blocks) and self.blocks[j].kind == "layer":
            self.uploads.upload(self.blocks[j].uses, blocking=False)

    def _prefetch_from(self, index: int, step: int) -> None:
        for d in range(1, self.prefetch + 1):
            j = index + d * step
            if 0 <= j < len(self.blocks):
                uses = self.blocks[j].uses
                if self.blocks[j].kind == "embed" and self.next_rows is not None and self.next_rows.pending():
                    uses = [n for n in uses if n != self.next_rows.name]  # the next lookup has its rows
                if uses:
                    self.window.prefetch(uses)

    # called by the layer wrappers
    def block_forward_begin(self, blk) -> None:
        fault("forward.layer")
        self.heap.check()
        self._prefetch_from(blk.index, +1)
        self._load(blk.uses)
        self._upload_ahead(blk.index + 1)
        self.hooks.begin_count()
        self.acts.forward_begin(blk)
        self._t_compute = time.perf_counter()

    def block_forward_end(self, blk) -> None:
        synchronize(self.device)
        t1 = time.perf_counter()
        self.timeline.event("compute", f"fwd {blk.name}", self._t_compute, t1)
        self.acts.forward_end(blk, t1 - self._t_compute, self.hooks.end_count())
        self._unload(blk.uses)

    def block_backward_begin(self, blk) -> None:
        fault("backward.layer")
        self.heap.check()
        if self._held_head:
            self._head_computed("bwd", self._t_bwd)
        self._drop_head()  # the head's backward is over once a layer's starts
        self._load(blk.uses)
        self._prefetch_from(blk.index, -1)
        self._upload_ahead(blk.index - 1)
        self.acts.backward_begin(blk)
        self.hooks.begin_count()
        self._blocked0 = self.optimizer.blocked_s
        self._t_compute = time.perf_counter()

    def block_backward_end(self, blk) -> None:
        synchronize(self.device)
        t1 = time.perf_counter()
        self.timeline.event("compute", f"bwd {blk.name}", self._t_compute, t1)
        # time spent handing gradients to an optimizer that was behind is a wait, not compute
        blocked = self.optimizer.blocked_s - self._blocked0
        self.acts.waited(blocked)
        self.acts.backward_end(blk, t1 - self._t_compute - blocked, self.hooks.end_count())
        self._unload(blk.uses)

    def policy_for(self, blk) -> str:
        return self.acts.policy_for(blk)
