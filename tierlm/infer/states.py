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

import inspect
from dataclasses import dataclass

import torch

STATE_CALLS = ("update_conv_state", "update_recurrent_state")


_STORES: dict[type, bool] = {}


def stores_states(module) -> bool:
    """Whether this module's own forward stores a conv or recurrent state through the cache."""
    cls = type(module)
    if cls not in _STORES:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        _STORES[cls] = any(c in src for c in STATE_CALLS)
    return _STORES[cls]


def keeps_states(model) -> bool:
    """Whether any of the model's modules stores a conv or recurrent state through the cache."""
    return any(stores_states(m) for m in model.modules())


def kv_layers(attention_modules) -> set[int]:
    """The layers that keep keys and values: those of the attention modules that are not linear
    attention (Kimi's KimiDeltaAttention is named like attention and keeps states)."""
    return {m.layer_idx for m in attention_modules if not stores_states(m)}


@dataclass(frozen=True)
class StateShape:
    layer: int
    index: int                  # a layer may keep several (Kimi's q, k and v convolutions)
    kind: str                   # "conv" | "recurrent"
    shape: tuple[int, ...]      # one sequence's, without the batch dimension
    wide: bool                  # kept in fp32 whatever the compute dtype (the model computes it so)


class _Recorder:
    """What a forward on `meta` stores: the cache calls transformers' state layers make, recorded."""

    def __init__(self):
        self.shapes: dict[tuple[int, int, str], StateShape] = {}

    def update(self, key, value, layer_idx, *args, **kwargs):
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return query_length, 0

    def get_conv_state(self, layer_idx, state_idx=0):
        return None

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return None

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        return False

    def is_recording_past(self, layer_idx) -> bool:
        return False

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        k = conv_kernel_size or conv_states.shape[-1]
        self._note(layer_idx, state_idx, "conv", tuple(conv_states.shape[1:-1]) + (k,), conv_states.dtype)
        if conv_states.shape[-1] < k:
            conv_states = torch.nn.functional.pad(conv_states, (k - conv_states.shape[-1], 0))
        return conv_states

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self._note(layer_idx, state_idx, "recurrent", tuple(recurrent_states.shape[1:]), recurrent_states.dtype)
        return recurrent_states

    def _note(self, layer, index, kind, shape, dtype):
        self.shapes[(layer, index, kind)] = StateShape(layer, index, kind, shape, dtype == torch.float32)


def probe(config, attends: bool) -> list[StateShape]:
    """The states each layer of `config`'s model keeps for one sequence, from its own forward on
    `meta`. In bf16: the meta kernels of grouped expert products take no other dtype; a state the
    model keeps in fp32 beside bf16 activations (the recurrences) is marked wide."""
    import copy
    from ..hf.structure import empty_model
    from .kvcache import cache_kwarg
    c = copy.deepcopy(config)
    c._attn_implementation = "eager"
    c.dtype = torch.bfloat16
    if getattr(c, "output_router_logits", False):
        c.output_router_logits = False
    model = empty_model(c).eval().to(device="meta", dtype=torch.bfloat16)
    rec = _Recorder()
    ids = torch.zeros((1, 2), dtype=torch.long, device="meta")
    # a 4-D mask, as the engine's steps give (a model without attention takes none)
    mask = torch.ones((1, 1, 2, 2), dtype=torch.bool, device="meta") if attends else None
    try:
        with torch.no_grad(), torch.device("meta"):
            model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): rec})
    except Exception as e:  # noqa: BLE001 -- the reason goes into the refusal
        raise ValueError(f"{config.model_type}: its layers keep recurrent states, and running its forward on "
                         f"the meta device to size them failed ({type(e).__name__}: {e})") from e
    return sorted(rec.shapes.values(), key=lambda s: (s.layer, s.index, s.kind))


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
