"""Recurrent layers' states beside the KV cache: one preallocated slot per sequence.

State-space layers (Mamba, Mamba-2), linear attention (Qwen3-Next's and Qwen3.5's Gated DeltaNet,
OLMo-Hybrid's, Kimi's) and short convolutions (LFM2) keep no keys and values: after each token a
layer holds a fixed-size state, a convolution's last few inputs and a recurrence's matrix. transformers'
modules read and write them through the cache object (`get_conv_state`, `update_conv_state`,
`get_recurrent_state`, `update_recurrent_state`), the same way in every family that has them; the
KV cache (kvcache.py) answers those calls from these slots, so a new family with such layers needs
no code here.

Their shapes come from the model itself, not from per-family formulas: `probe` runs the model's
own forward on the `meta` device (no memory, no arithmetic) with a cache that records what each
layer stores. The slots are allocated and touched once, inside the budget, like the KV cache's.
"""
from __future__ import annotations

import ast
import functools
import inspect
import re
import sys

import torch

from ..hf import meta_forward
from ..hf.meta_forward import STATE_CALLS, StateShape  # noqa: F401 -- StateShape: what probe gives


_STORES: dict[type, bool] = {}
_CALLED = re.compile(r"(self\.)?\b([A-Za-z_]\w*)\s*\(")


@functools.cache
def _module_functions(name: str) -> dict[str, str]:
    """The source of each function defined at the top of module `name`, by its name: read from the
    file, as a decorator may have made the name something else (transformers 5.25 makes its
    `use_kernel_forward_from_hub` functions modules of the `kernels` package)."""
    try:
        src = inspect.getsource(sys.modules[name])
    except (KeyError, OSError, TypeError):
        return {}
    return {n.name: ast.get_source_segment(src, n) or "" for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def stores_states(module) -> bool:
    """Whether this module's own forward stores a conv or recurrent state through the cache: in its
    own code, or in the methods and module functions it calls (two calls deep: transformers 5.25's
    Mamba and Gated DeltaNet layers call `causal_conv1d_forward`, which stores the conv state)."""
    cls = type(module)
    if cls not in _STORES:
        found, seen = False, set()
        todo = [(_source(cls.forward), getattr(cls.forward, "__module__", None), 0)]
        while todo and not found:
            src, mod, depth = todo.pop()
            found = any(c in src for c in STATE_CALLS)
            if depth == 2:
                continue
            funcs = _module_functions(mod) if mod else {}
            for own, name in set(_CALLED.findall(src)):
                if (own, name) in seen:
                    continue
                seen.add((own, name))
                if own:
                    fn = getattr(cls, name, None)
                    if inspect.isfunction(fn):
                        todo.append((_source(fn), fn.__module__, depth + 1))
                elif name in funcs:
                    todo.append((funcs[name], mod, depth + 1))
        _STORES[cls] = found
    return _STORES[cls]


def keeps_states(model) -> bool:
    """Whether any of the model's modules stores a conv or recurrent state through the cache."""
    return any(stores_states(m) for m in model.modules())


def kv_layers(attention_modules, config=None) -> set[int]:
    """The layers that keep keys and values: those of the attention modules that are not linear
    attention (Kimi's KimiDeltaAttention is named like attention and keeps states), and, with
    `config`, every layer its model's forward on `meta` stored keys and values for: one attention
    module several layers run (Zamba's shared block) knows no layer of its own (None, or Zamba2's
    -1: counted as a layer, the budget held a KV cache too many), and is handed the layer at each
    call."""
    found = {getattr(m, "layer_idx", None) if hasattr(m, "layer_idx") else m.layer_id
             for m in attention_modules if not stores_states(m)}
    if config is not None:
        found |= set(meta_forward.record(config, bool(attention_modules)).kv)
    return {i for i in found if i is not None and i >= 0}


def probe(config, attends: bool) -> list[StateShape]:
    """The states each layer of `config`'s model keeps for one sequence, from its own forward on
    `meta` (hf.meta_forward)."""
    try:
        rec = meta_forward.record(config, attends)
    except Exception as e:  # noqa: BLE001 -- the reason goes into the refusal
        raise ValueError(f"{config.model_type}: its layers keep recurrent states, and running its forward on "
                         f"the meta device to size them failed ({type(e).__name__}: {e})") from e
    return sorted(rec.states.values(), key=lambda s: (s.layer, s.index, s.kind))


class StateSlots:
    """Every state of every layer for `slots` sequences, allocated (and touched) once."""

    def __init__(self, shapes: list[StateShape], slots: int, dtype: torch.dtype, device=None):
        self.shapes = shapes
        self.t: dict[tuple[int, int, str], torch.Tensor] = {}
        for s in shapes:
            dt = torch.float32 if s.wide else dtype
            self.t[(s.layer, s.index, s.kind)] = torch.zeros((slots,) + s.shape, dtype=dt, device=device)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.t.values())

    @staticmethod
    def transient_bytes(shapes: list[StateShape], tokens: int, rows: int) -> int:
        """What a layer's recurrent path adds while it runs, beyond the activations the engine plans
        (plan.inference.scratch_bytes): its states read, computed and written (a few copies of one
        layer's, for the step's rows, in fp32) and its convolution's inputs with their left context,
        in fp32, for the step's tokens."""
        per_layer: dict[int, int] = {}
        width = 0
        for s in shapes:
            per_layer[s.layer] = per_layer.get(s.layer, 0) + _numel(s.shape) * 4
            if s.kind == "conv":
                width = max(width, _numel(s.shape[:-1]))
        return 4 * rows * max(per_layer.values(), default=0) + 4 * (tokens + rows * 8) * width * 4

    @staticmethod
    def bytes_for(shapes: list[StateShape], slots: int, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(slots * _numel(s.shape) * (4 if s.wide else size) for s in shapes)

    def get(self, layer: int, index: int, kind: str) -> torch.Tensor:
        try:
            return self.t[(layer, index, kind)]
        except KeyError:
            raise RuntimeError(f"layer {layer} keeps a {kind} state {index} that the probe of the model did not "
                               f"see (a tierlm bug: please report it with the model's config.json)") from None

    def zero(self, slots: list[int]) -> None:
        if slots:
            for t in self.t.values():
                t[slots] = 0

    def move(self, src: int, dst: int) -> None:
        for t in self.t.values():
            t[dst].copy_(t[src])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
