"""What a model keeps between tokens, read from its own forward on the `meta` device.

A config does not always say what a layer caches: MiMo-V2-Flash's sliding layers keep twice the
key/value heads its config gives, GPT-BigCode's multi-query attention one head whatever
`num_key_value_heads` says, and state-space or linear-attention layers keep states no field sizes.
The model's forward knows: run on `meta` (no memory, no arithmetic) with a cache that records each
call the layers make on it, it gives every layer's keys, values and states as the model computes
them. The KV cache (`tierlm.hf.kv_layout`) and the recurrent states (`tierlm.infer.states`) are
sized from this record, so a new family needs no formula here.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass, field

import torch

STATE_CALLS = ("update_conv_state", "update_recurrent_state")


def cache_kwarg(model) -> str:
    """The keyword `model.forward` takes the KV cache by: `cache` in the transformers that renamed
    it (where `past_key_values` still works but warns on every call, in the middle of a chat's
    output), `past_key_values` in those before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class StateShape:
    layer: int
    index: int                  # a layer may keep several (Kimi's q, k and v convolutions)
    kind: str                   # "conv" | "recurrent"
    shape: tuple[int, ...]      # one sequence's, without the batch dimension
    wide: bool                  # kept in fp32 whatever the compute dtype (the model computes it so)


@dataclass
class Record:
    """What each layer stored through the cache in one forward."""
    # layer -> ((heads, dim) of its keys, the same of its values), as passed to `cache.update`
    kv: dict[int, tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)
    index_keys: dict[int, int] = field(default_factory=dict)    # layer -> a sparse indexer's key width
    states: dict[tuple[int, int, str], StateShape] = field(default_factory=dict)


class _Recorder:
    """The cache the forward on `meta` is given: it answers as an empty cache and records each store.
    What else a forward reads of its cache (Inkling 2's `is_sliding`, the per-layer objects Qwen4-Exp
    keeps its indexer's positions on) comes from an empty `DynamicCache` made from the config, as
    the model's own forward would make it."""

    def __init__(self, config=None):
        self.record = Record()
        self._config = config
        self._like = None

    def __getattr__(self, name):  # only for what the methods below do not answer
        if name.startswith("_"):
            raise AttributeError(name)
        if self._like is None:
            from transformers import DynamicCache
            self._like = DynamicCache(config=self._config)
        return getattr(self._like, name)

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.record.kv[layer_idx] = ((key.shape[1], key.shape[-1]), (value.shape[1], value.shape[-1]))
        return key, value

    def update_indexer(self, key, layer_idx, *args, **kwargs):
        self.record.index_keys[layer_idx] = key.shape[-1]
        return key

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

    def get_recurrent_states_to_keep(self, layer_idx=None) -> int:
        return 0

    def increase_count(self, layer_idx, state_idx=0) -> None:
        pass

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        k = conv_kernel_size or conv_states.shape[-1]
        self._note(layer_idx, state_idx, "conv", tuple(conv_states.shape[1:-1]) + (k,), conv_states.dtype)
        if conv_states.shape[-1] < k:
            conv_states = torch.nn.functional.pad(conv_states, (k - conv_states.shape[-1], 0))
        return conv_states

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        if not isinstance(recurrent_states, torch.Tensor):  # a prompt's last states, the final one last
            recurrent_states = recurrent_states[-1]
        self._note(layer_idx, state_idx, "recurrent", tuple(recurrent_states.shape[1:]), recurrent_states.dtype)
        return recurrent_states

    def _note(self, layer, index, kind, shape, dtype):
        self.record.states[(layer, index, kind)] = StateShape(layer, index, kind, shape, dtype == torch.float32)


_RECORDS: dict[tuple, Record | BaseException] = {}


def _key(config, what) -> tuple | None:
    try:
        return type(config).__name__, config.to_json_string(use_diff=False), what
    except Exception:  # noqa: BLE001 -- a config that cannot be written is recorded anew each time
        return None


def record(config, attends: bool) -> Record:
    """The stores of `config`'s model's forward over two tokens of one sequence, on `meta`; with
    `attends`, given a 4-D mask as the engine's steps give (a model without attention takes none).
    In bf16: the meta kernels of grouped expert products take no other dtype; a state the model
    keeps in fp32 beside bf16 activations (the recurrences) is marked wide. Raises what the forward
    raised (a mixture that routes by data-dependent shapes cannot run on `meta`). Kept per config:
    a full-size model's forward on `meta` takes a second or two."""
    key = _key(config, attends)
    if key is not None and key in _RECORDS:
        got = _RECORDS[key]
        if isinstance(got, BaseException):
            raise got
        return got
    try:
        got = _run(config, attends)
    except Exception as e:  # noqa: BLE001 -- kept, so a failing model is not built again
        if key is not None:
            _RECORDS[key] = e
        raise
    if key is not None:
        _RECORDS[key] = got
    return got


def meta_model(config):
    """`config`'s model on `meta` for a forward that reads no weight: eager attention, in bf16 (the
    meta kernels of grouped expert products take no other dtype) but for what transformers keeps in
    fp32 in a bf16 model (Inkling 2's routers: its forward multiplies fp32 by them), no router
    logits recorded."""
    from .structure import cast, empty_model
    c = copy.deepcopy(config)
    c._attn_implementation = "eager"
    c.dtype = torch.bfloat16
    if getattr(c, "output_router_logits", False):
        c.output_router_logits = False
    return cast(empty_model(c).eval(), torch.bfloat16, "meta")


@contextlib.contextmanager
def on_meta():
    """Where a forward on `meta` runs: no gradients, new tensors on `meta`, and `nonzero` sized as
    if every element were nonzero (Qwen4-Exp's indexer and experts' routing: the largest shape, so
    what is sized from it is an upper bound, where torch would refuse)."""
    from torch.fx.experimental import _config as fx_config
    with torch.no_grad(), torch.device("meta"), fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        yield


def _run(config, attends: bool) -> Record:
    model = meta_model(config)
    rec = _Recorder(model.config)
    ids = torch.zeros((1, 2), dtype=torch.long, device="meta")
    mask = torch.ones((1, 1, 2, 2), dtype=torch.bool, device="meta") if attends else None
    with on_meta():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): rec})
    return rec.record



def layer_calls(config) -> list[int] | None:
    """How often the model's forward over two tokens runs each decoder layer: once, but in a
    recurrent-depth model (Dory runs its middle layers n_recurrent_loops times). Counted on `meta`,
    or where the forward cannot run there (Dory's masks read a value), on a copy of every layer at
    tiny widths (hf.fields.shrunk) of at most 20M parameters. None where neither runs."""
    return _per_config(config, "calls", _layer_calls)


_PROBES: dict[tuple, object] = {}


def _per_config(config, what: str, probe):
    """probe(config), kept per config (a model's engine is built more than once in a process)."""
    key = _key(config, what)
    if key is not None and key in _PROBES:
        return _PROBES[key]
    got = probe(config)
    if key is not None:
        _PROBES[key] = got
    return got


def _layer_calls(config) -> list[int] | None:
    from .fields import get, shrunk
    try:
        return _count_calls(meta_model(config), on_meta)
    except Exception:  # noqa: BLE001 -- a value read on meta: the small copy below
        pass
    try:
        small = shrunk(config, layers=get(config, "layers"))  # every layer, so the sections stay as given
        small._attn_implementation = "eager"
        if sum(p.numel() for p in meta_model(small).parameters()) > 20_000_000:
            return None
        from transformers import AutoModelForCausalLM
        with torch.random.fork_rng():
            model = AutoModelForCausalLM.from_config(small).eval()
        return _count_calls(model, torch.no_grad)
    except Exception:  # noqa: BLE001 -- not counted
        return None


def _count_calls(model, context) -> list[int]:
    from .structure import find_layers
    _, layers = find_layers(model)
    counts = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1))
    with context():
        model(input_ids=torch.zeros((1, 2), dtype=torch.long), use_cache=False)
    return counts


def sees_later_tokens(config) -> bool | None:
    """Whether a token's logits move when a later token changes, on a tiny copy (hf.fields.shrunk)
    of the model: a causal LM's do not. BertGeneration's decoder is bidirectional unless its config
    says is_decoder, and a causal loss on it trains it to copy the next token from its input. None
    where the copy cannot be made or run."""
    return _per_config(config, "sees later tokens", _sees_later_tokens)


def _sees_later_tokens(config) -> bool | None:
    from transformers import AutoModelForCausalLM

    from .fields import shrunk
    try:
        small = shrunk(config, layers=2, every_kind=True)
        small._attn_implementation = "eager"
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(small).float().eval()
            ids = torch.randint(0, small.vocab_size, (1, 6))
        other = ids.clone()
        other[0, -1] = (ids[0, -1] + 1) % small.vocab_size
        with torch.no_grad():
            a, b = (model(input_ids=t, use_cache=False).logits[0, :-1] for t in (ids, other))
    except Exception:  # noqa: BLE001 -- not probed
        return None
    return not torch.allclose(a, b, rtol=1e-4, atol=1e-5 * max(a.abs().max().item(), 1.0))
