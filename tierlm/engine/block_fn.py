"""Autograd boundaries around each decoder layer, and saved tensors that do not pin weights.

Each decoder layer runs inside a custom autograd Function whose backward is the moment that layer's
backward starts: the engine fetches its weights there (prefetched), and the layer's own graph
(kept from forward, or recomputed from its input) is run backward inside it. Parameters saved by
autograd (a linear layer saves its weight) are packed as references to the parameter and re-resolved
at unpack time, so a saved graph never keeps a streamed weight in memory.
"""
from __future__ import annotations

import contextlib

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
    """What one call of a decoder layer needs: its engine, block, original forward and arguments."""

    __slots__ = ("engine", "block", "fn", "args", "kwargs", "policy", "recorded")

    def __init__(self, engine, block, fn, args, kwargs, policy):
        self.engine, self.block, self.fn, self.args, self.kwargs, self.policy = engine, block, fn, args, kwargs, policy
        self.recorded: list = []  # [(key, tensor)] the model's recorders took inside the layer


class BlockFunction(torch.autograd.Function):
    """One decoder layer: its hidden states out, then what transformers recorded inside it.

    A model that records a layer's inner outputs for its loss (a mixture of experts' router logits,
    for the load-balancing loss its causal LM adds) gets them back as outputs of this Function, so
    their gradient reaches the layer during the layer's backward, when its weights are loaded."""

    @staticmethod
    def forward(ctx, call: BlockCall, hidden: torch.Tensor):
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
                with eng.hooks, recorded() as extras:
                    out = call.fn(hidden, *call.args, **call.kwargs)
                ctx.out = ctx.extras = None
                call.recorded = extras
                return (out, *[t for _, t in extras])
            h = hidden.detach().requires_grad_(True)
            with torch.enable_grad(), eng.hooks, recorded() as extras:
                out = call.fn(h, *call.args, **call.kwargs)
            ctx.h, ctx.out, ctx.extras = h, out, [t for _, t in extras]
            call.recorded = extras
            return (out.detach(), *[t.detach() for _, t in extras])
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
                devices = [h.device] if h.is_cuda else []
                with torch.random.fork_rng(devices=devices), torch.enable_grad(), eng.hooks, \
                        recorded([k for k, _ in call.recorded]) as again:
                    torch.set_rng_state(ctx.rng)
                    if ctx.dev_rng is not None:
                        torch.cuda.set_rng_state(ctx.dev_rng, h.device)
                    out = call.fn(h, *call.args, **call.kwargs)
                extras = [t for _, t in again]
            else:
                h, out, extras = ctx.h, ctx.out, ctx.extras
                ctx.h = ctx.out = ctx.extras = None
            pairs = [(t, g) for t, g in zip([out, *extras], [grad_out, *grad_extras])
                     if g is not None and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            return None, h.grad
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
    layer reads), or a list (OpenAI GPT's), give BlockFunction their hidden states and the model
    the tuple or list back, the rest of it as the layer's forward made it (detached: no gradient
    flows through it)."""
    layer_forward = layer.forward
    returns: type | None = None  # tuple or list, where the layer returns one
    tail: tuple = ()

    def original(*args, **kwargs):
        nonlocal returns, tail
        out = layer_forward(*args, **kwargs)
        if isinstance(out, (tuple, list)):
            returns = list if isinstance(out, list) else tuple
            tail = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in out[1:])
            return out[0]
        return out

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
        call = BlockCall(engine, block, original, rest, kwargs, engine.policy_for(block))
        out, *extras = BlockFunction.apply(call, hidden)
        if extras:  # the model's collector gets the Function's outputs in place of the inner tensors
            from transformers.utils.output_capturing import _active_collector
            lists = _active_collector.get()
            for (k, inner), t in zip(call.recorded, extras):
                lst = lists[k]
                lst[next(i for i in range(len(lst) - 1, -1, -1) if lst[i] is inner)] = t
        call.recorded = [(k, None) for k, _ in call.recorded]  # keys only: no tensor kept
        return returns((out, *tail)) if returns is not None else out

    layer.forward = forward
