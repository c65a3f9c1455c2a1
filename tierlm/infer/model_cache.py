"""A sequence's cache made by the model itself, for families whose layers keep what tierlm's slot
cache does not hold (DeepSeek-V4's compressed attention keeps a sliding window, compressed entries
and the compressor's overlap and pending windows in its own cache layers; MiniMax refuses any cache
but its own, which holds its lightning-attention layers' states).

Each slot holds the object the model's forward returns when it is handed none: what
`transformers.generate` keeps for a sequence, grown by the model's own code. A step runs each row
in its own forward (generic.GenericStep, masks "cache"): the rows of a batch share no tensor, so
they cannot share a forward. The bytes a slot may hold are measured, not derived from the config:
the model's forward on `meta` over `max_len` positions, with its own cache, through the same code
that grows it at run time (`slot_bytes`), and the budget keeps that much a slot.
"""
from __future__ import annotations

import torch

from ..hf.meta_forward import cache_kwarg, meta_model, on_meta
from ..storage import BudgetError
from ..units import fmt_bytes


def returned_cache(out):
    """The cache a forward returned: `cache` in the outputs of transformers that renamed it (whose
    `past_key_values` property warns on every read), `past_key_values` in those before."""
    got = getattr(out, "cache", None)
    return got if got is not None else getattr(out, "past_key_values", None)


def tensor_bytes(obj, bf16_as: int = 2) -> int:
    """Bytes of the tensors `obj` holds: in its attributes, its layers' and their lists, tuples and
    dicts (each tensor once, however often it is referred to); a bf16 one's elements counted as
    `bf16_as` bytes each."""
    seen: set[int] = set()
    total = 0
    todo = [obj]
    visited: set[int] = set()
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:
                seen.add(id(x))
                total += x.numel() * (bf16_as if x.dtype == torch.bfloat16 else x.element_size())
            continue
        if id(x) in visited or isinstance(x, (str, bytes, int, float, bool, type(None))):
            continue
        visited.add(id(x))
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple, set)):
            todo.extend(x)
        elif hasattr(x, "__dict__") and not isinstance(x, (torch.nn.Module, type)):
            todo.extend(vars(x).values())
    return total


def slot_bytes(config, max_len: int, dtype: torch.dtype) -> int:
    """The most bytes one sequence's cache holds up to `max_len` positions, measured with the
    model's forward on `meta` (no weight is read): its prompt whole, and after one more position
    (a decode step may keep what a prompt's last step did not). Run in bf16 (the meta kernels of
    grouped expert products take no other dtype), what the cache keeps in bf16 counted in `dtype`,
    what it keeps wider (fp32 states) as it is. Raises what the forward raises."""
    key = (type(config).__name__, config.to_json_string(use_diff=False), max_len, str(dtype))
    if key not in _MEASURED:
        _MEASURED[key] = _run(config, max_len, dtype)
    return _MEASURED[key]


_MEASURED: dict[tuple, int] = {}


def _run(config, max_len: int, dtype: torch.dtype) -> int:
    model = meta_model(config)
    width = torch.empty((), dtype=dtype).element_size()
    most = 0
    with on_meta():
        out = model(input_ids=torch.zeros((1, max(max_len - 1, 1)), dtype=torch.long), use_cache=True)
        cache = returned_cache(out)
        most = tensor_bytes(cache, width)
        if max_len > 1:
            model(input_ids=torch.zeros((1, 1), dtype=torch.long), use_cache=True, **{cache_kwarg(model): cache})
            most = max(most, tensor_bytes(cache, width))
    return most


class ModelCaches:
    """One model-made cache per slot (None until the slot's first step), kept compact as the
    slot cache is (a finishing sequence's slot takes the last one's)."""

    def __init__(self, slots: int, max_len: int, per_slot: int):
        self.slots, self.max_len, self.per_slot = slots, max_len, per_slot
        self.nbytes = slots * per_slot
        self.caches: list = [None] * slots
        self.lengths = [0] * slots
        self.bytes_read = 0  # the caches' bytes the steps' attention read, for the bandwidth report
        self.states = None   # (no recurrent states of the engine's: the model's cache keeps them)
        self.indexed = False

    def take(self, slot: int, start: int, tokens: int):
        """The cache row `slot` continues at position `start` (a fresh one at 0), its bytes
        counted as read; the slot's length then advances by `tokens`."""
        if start == 0:
            self.caches[slot], self.lengths[slot] = None, 0
        elif start != self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} positions; a step cannot continue it at {start} "
                             f"(the model's own cache grows only at its end)")
        cache = self.caches[slot]
        if cache is not None:
            self.bytes_read += tensor_bytes(cache)
        self.lengths[slot] = start + tokens
        return cache

    def keep(self, slot: int, cache) -> None:
        self.caches[slot] = cache

    def move(self, src: int, dst: int, length: int) -> None:
        """Slot src's cache into slot dst (compaction after a finish)."""
        self.caches[dst], self.lengths[dst] = self.caches[src], length
        self.caches[src], self.lengths[src] = None, 0

    def check_fits(self, positions: int, what: str = "the request") -> None:
        if positions > self.max_len:
            raise BudgetError(
                f"{what} needs {positions} positions (prompt + max tokens) but each cache slot holds "
                f"{self.max_len}; shorten it or raise --max-seq-len (cache: {self.slots} slots of the model's own "
                f"cache, {fmt_bytes(self.nbytes)})")
