"""Autograd boundaries around each decoder layer, and saved tensors that do not pin weights.

Each decoder layer runs inside a custom autograd Function whose backward is the moment that layer's
backward starts: the engine fetches its weights there (prefetched), and the layer's own graph
(kept from forward, or recomputed from its input) is run backward inside it. Parameters saved by
autograd (a linear layer saves its weight) are packed as references to the parameter and re-resolved
at unpack time, so a saved graph never keeps a streamed weight in memory.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import MutableMapping

import torch
from torch import nn

from .activations import Handle


class ParamRef:
    __slots__ = ("param", "size", "stride", "rel_offset")

    def __init__(self, param: nn.Parameter, t: torch.Tensor):
        self.param = param
        self.size = t.size()
        self.stride = t.stride()
        self.rel_offset = t.storage_offset() - param.data.storage_offset()


class ParamRefHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that replace views of streamed parameters by references.

    Every other saved tensor is an activation: counted (by distinct storage, since autograd often
    saves several views of one tensor), and handed to the swapper when the layer being run swaps.
    """

    def __init__(self, swapper=None):
        self.by_storage: dict[int, nn.Parameter] = {}
        self.swapper = swapper
        self.saved_bytes = 0  # activation bytes packed since the last reset (measured, per block)
        self._seen: dict[int, object] | None = None  # data_ptr -> storage while counting a block
        super().__init__(self._pack, self._unpack)

    def begin_count(self) -> None:
        self.saved_bytes = 0
        self._seen = {}  # storages held while counting, so an address is not reused and recounted

    def end_count(self) -> int:
        self._seen = None
        return self.saved_bytes

    def track(self, param: nn.Parameter) -> None:
        self.by_storage[param.data.untyped_storage().data_ptr()] = param

    def untrack(self, param: nn.Parameter) -> None:
        self.by_storage.pop(param.data.untyped_storage().data_ptr(), None)

    def _pack(self, t: torch.Tensor):
        if t.layout == torch.strided and t.device.type != "meta":
            p = self.by_storage.get(t.untyped_storage().data_ptr())
            if p is not None:
                return ParamRef(p, t)
            st = t.untyped_storage()
            if self._seen is not None and st.data_ptr() not in self._seen:
                self._seen[st.data_ptr()] = st
                self.saved_bytes += st.nbytes()
            if self.swapper is not None and self.swapper.active:
                return self.swapper.pack(t)
        return t

    def _unpack(self, x):
        if isinstance(x, Handle):
            return self.swapper.unpack(x)
        if isinstance(x, ParamRef):
            d = x.param.data
            if d.numel() > 1 and 0 in d.stride():
                raise RuntimeError(f"a streamed weight {tuple(x.param.shape)} was needed in backward but is not loaded")
            return d.as_strided(x.size, x.stride, d.storage_offset() + x.rel_offset)
        return x


class BlockCall:
    """What one call of a decoder layer needs: its engine, block, original forward and arguments.

    Tensors with a gradient that the layer reads beside its hidden states, made outside it (Gemma 4's
    per-layer input, made from weights before the layers; ZAYA's router states, handed on by the
    layer before; the keys and values an earlier layer left in Gemma 4's shared_kv_states), are
    `carried`: inputs of BlockFunction, replaced inside the layer by leaves whose gradients its
    backward returns, so autograd takes them to whatever made them. What the layer hands on with a
    gradient (the floating tensors it returns after its hidden states, or writes into a mapping
    among its arguments) is `left`: outputs of BlockFunction, so the gradients later layers send
    them reach this layer's backward."""

    __slots__ = ("engine", "block", "fn", "args", "kwargs", "policy", "recorded", "slots", "snaps", "tail", "writes",
                 "returns")

    def __init__(self, engine, block, fn, args, kwargs, policy):
        self.engine, self.block, self.fn, self.args, self.kwargs, self.policy = engine, block, fn, args, kwargs, policy
        self.recorded: list = []  # [(key, tensor)] the model's recorders took inside the layer
        # the mappings among the arguments as they were when the layer was called (a later layer may
        # write into them before this one's backward runs it again)
        self.snaps = {k: copy.copy(v) for k, v in kwargs.items() if isinstance(v, MutableMapping)}
        self.slots: list[tuple] = []  # where each carried tensor goes (_bind)
        self.returns: type | None = None  # tuple or list, where the layer returns one
        self.tail: tuple = ()   # what the layer returned after its hidden states
        self.writes: list = []  # [(argument, key, value)] what it wrote into a mapping argument

    def carried(self) -> list[torch.Tensor]:
        """The tensors with a gradient the layer reads beside its hidden states; notes their slots."""
        out = []
        for i, t in enumerate(self.args):
            if _grad(t):
                self.slots.append(("arg", i, None))
                out.append(t)
        for k, t in self.kwargs.items():
            if _grad(t):
                self.slots.append(("kw", k, None))
                out.append(t)
        for name, m in self.snaps.items():
            for key, v in m.items():
                for j, t in enumerate(v if isinstance(v, (tuple, list)) else (v,)):
                    if _grad(t):
                        self.slots.append(("map", name, key, j if isinstance(v, (tuple, list)) else None))
                        out.append(t)
        return out

    def run(self, hidden: torch.Tensor, carried) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layer on `hidden` with `carried` in their slots: its hidden states out, and the
        floating tensors it left (returned after them, then written into mappings, in order)."""
        args, kwargs = list(self.args), dict(self.kwargs)
        copies = {name: copy.copy(m) for name, m in self.snaps.items()}
        kwargs.update(copies)
        for (kind, name, key, *j), t in zip(self.slots, carried):
            if kind == "arg":
                args[name] = t
            elif kind == "kw":
                kwargs[name] = t
            else:
                m, j = copies[name], j[0]
                m[key] = t if j is None else type(m[key])(t if i == j else x for i, x in enumerate(m[key]))
        out = self.fn(hidden, *args, **kwargs)
        if isinstance(out, (tuple, list)):
            self.returns, self.tail, out = type(out), tuple(out[1:]), out[0]
        self.writes = [(name, key, v) for name, m in copies.items() for key, v in m.items()
                       if key not in self.snaps[name] or self.snaps[name][key] is not v]
        left = [t for t in self.tail if _floating(t)]
        left += [t for _, _, v in self.writes for t in (v if isinstance(v, (tuple, list)) else (v,)) if _floating(t)]
        return out, left


def _grad(t) -> bool:
    """A tensor with a gradient made outside the layer (a parameter handed in is the layer's to
    use as its own: its gradient accumulates as the layer's weights' do)."""
    return isinstance(t, torch.Tensor) and t.requires_grad and not isinstance(t, nn.Parameter)


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class BlockFunction(torch.autograd.Function):
    """One decoder layer: its hidden states out, then what transformers recorded inside it, then
    what the layer left for later layers (BlockCall); in: the hidden states, then the carried.

    A model that records a layer's inner outputs for its loss (a mixture of experts' router logits,
    for the load-balancing loss its causal LM adds) gets them back as outputs of this Function, so
    their gradient reaches the layer during the layer's backward, when its weights are loaded."""

    @staticmethod
    def forward(ctx, call: BlockCall, hidden: torch.Tensor, *carried: torch.Tensor):
        eng = call.engine
        ctx.call = call
        ctx.set_materialize_grads(False)
        eng.block_forward_begin(call.block)
        try:
            if call.policy == "recompute":
                ctx.rng = torch.get_rng_state()
                # dropout on a GPU draws from that device's generator: replayed as well
                ctx.dev_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
                ctx.saved_input = hidden.detach()
                ctx.saved_carried = [c.detach() for c in carried]
                with eng.hooks, recorded() as extras:
                    out, left = call.run(hidden, carried)
                ctx.out = ctx.extras = None
                call.recorded = extras
                return (out, *[t for _, t in extras], *left)
            h = hidden.detach().requires_grad_(True)
            leaves = [c.detach().requires_grad_(True) for c in carried]
            with torch.enable_grad(), eng.hooks, recorded() as extras:
                out, left = call.run(h, leaves)
            ctx.h, ctx.leaves, ctx.out, ctx.extras = h, leaves, out, [t for _, t in extras] + left
            call.recorded = extras
            return (out.detach(), *[t.detach() for _, t in extras], *[t.detach() for t in left])
        finally:
            eng.block_forward_end(call.block)

    @staticmethod
    def backward(ctx, grad_out, *grad_extras):
        call = ctx.call
        eng = call.engine
        eng.block_backward_begin(call.block)
        try:
            if call.policy == "recompute":
                h = ctx.saved_input.requires_grad_(True)
                leaves = [c.requires_grad_(True) for c in ctx.saved_carried]
                devices = [h.device] if h.is_cuda else []
                with torch.random.fork_rng(devices=devices), torch.enable_grad(), eng.hooks, \
                        recorded([k for k, _ in call.recorded]) as again:
                    torch.set_rng_state(ctx.rng)
                    if ctx.dev_rng is not None:
                        torch.cuda.set_rng_state(ctx.dev_rng, h.device)
                    out, left = call.run(h, leaves)
                extras = [t for _, t in again] + left
            else:
                h, leaves, out, extras = ctx.h, ctx.leaves, ctx.out, ctx.extras
                ctx.h = ctx.leaves = ctx.out = ctx.extras = None
            pairs = [(t, g) for t, g in zip([out, *extras], [grad_out, *grad_extras])
                     if g is not None and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            return (None, h.grad, *[c.grad for c in leaves])
        finally:
            ctx.call = None
            eng.block_backward_end(call.block)


@contextlib.contextmanager
def recorded(keys: list[str] | None = None):
    """[(key, tensor)] that transformers' output recorders (router logits, attention weights) append
    while the block runs, in the order they were appended. `keys`: collect these afresh (a
    recompute in backward, where no collector is active) instead of watching the model's collector."""
    from transformers.utils.output_capturing import _active_collector

    found: list[tuple[str, torch.Tensor]] = []
    outer = _active_collector.get()
    if keys is not None:
        fresh: dict = {k: [] for k in dict.fromkeys(keys)}
        token = _active_collector.set(fresh)
        try:
            yield found
        finally:
            _active_collector.reset(token)
        idx = dict.fromkeys(fresh, 0)
        for k in keys:  # the order the forward appended them in
            found.append((k, fresh[k][idx[k]]))
            idx[k] += 1
        return
    if not outer:
        yield found
        return
    before = {k: len(v) for k, v in outer.items() if isinstance(v, list)}
    order: list[str] = []
    # which key each append went to, in order: wrap the lists for the block's duration
    watched = {k: _Watched(outer[k], k, order) for k in before}
    outer.update(watched)
    try:
        yield found
    finally:
        for k, w in watched.items():
            outer[k] = w.inner
    seen = dict.fromkeys(before, 0)
    for k in order:
        t = outer[k][before[k] + seen[k]]
        seen[k] += 1
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            found.append((k, t))


class _Watched(list):
    """A collector list that notes, in one shared order, which key each append went to."""

    def __init__(self, inner: list, key: str, order: list):
        super().__init__()
        self.inner, self.key, self.order = inner, key, order

    def append(self, x) -> None:
        self.inner.append(x)
        self.order.append(self.key)

    def __len__(self) -> int:
        return len(self.inner)


def wrap_layer(engine, block, layer: nn.Module) -> None:
    """Route `layer`'s forward through BlockFunction (an instance attribute: names stay HF's).

    Layers that return a tuple (Falcon's: hidden states, then optional attention weights; GLM-5's and
    HY-V4's: hidden states, then the token indices their sparse attention picked, which the next
    layer reads; ZAYA's: hidden states, then its router states), or a list (OpenAI GPT's), give
    BlockFunction their hidden states and the model the tuple or list back, the rest of it as the
    layer's forward made it; its floating tensors as BlockFunction's outputs, so a gradient a later
    layer sends them reaches this one (BlockCall). So are the tensors the layer writes into a
    mapping among its arguments (Gemma 4's shared_kv_states), written into the model's mapping."""
    layer_forward = layer.forward

    def forward(*args, **kwargs):
        if args:
            hidden, rest = args[0], args[1:]
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        if not (torch.is_grad_enabled() and engine.training):
            engine.block_forward_begin(block)
            try:
                with engine.hooks:
                    return layer_forward(hidden, *rest, **kwargs)
            finally:
                engine.block_forward_end(block)
        call = BlockCall(engine, block, layer_forward, rest, kwargs, engine.policy_for(block))
        out, *extras = BlockFunction.apply(call, hidden, *call.carried())
        n = len(call.recorded)
        recorded_out, left = extras[:n], iter(extras[n:])
        if recorded_out:  # the model's collector gets the Function's outputs in place of the inner tensors
            from transformers.utils.output_capturing import _active_collector
            lists = _active_collector.get()
            for (k, inner), t in zip(call.recorded, recorded_out):
                lst = lists[k]
                lst[next(i for i in range(len(lst) - 1, -1, -1) if lst[i] is inner)] = t
        # what the layer left: the Function's outputs in place of its floating tensors (in the order
        # BlockCall.run listed them); the rest as it made them, detached
        tail = tuple(next(left) if _floating(t) else t.detach() if isinstance(t, torch.Tensor) else t
                     for t in call.tail)
        for name, key, v in call.writes:
            if isinstance(v, (tuple, list)):
                v = type(v)(next(left) if _floating(t) else t for t in v)
            elif _floating(v):
                v = next(left)
            kwargs[name][key] = v
        call.recorded = [(k, None) for k, _ in call.recorded]  # keys only: no tensor kept
        call.tail, call.writes = (), []
        return call.returns((out, *tail)) if call.returns is not None else out

    layer.forward = forward
