"""A step through transformers' own modules, and the check that it computes what they compute.

`GenericStep` runs one step of rows (each row a KV-cache slot) through the model's forward: the
engine's packed rows or padded ones, its boolean masks (sliding windows decided as transformers'
mask creation decides), and the logits through the model's own forward where it keeps chosen
positions, so what a family does after its head (Gemma2's final soft-capping, Granite's logits
scaling) is its code, not ours.

`check` runs the same step on a tiny random copy of the model (its class and options, small
shapes: hf.fields.shrunk) and compares every logit with transformers' forward over each whole
sequence: a family whose attention or position code takes something this path does not give it
is refused by name instead of generating wrong tokens. Kept per config.

A family whose forward builds position biases from a 2-D padding mask (ALiBi: BLOOM, Falcon-RW)
cannot take the engine's 4-D masks. Where the check fails with them, it tries (`masks`):
- "layers": the model is given a 2-D mask of every key a step's rows read, from which it builds its
  biases (a key's index in a slot is its position, so biases by key index are biases by
  position), and each decoder layer the engine's 4-D mask in place of the one the model made
  (a pre-hook on its `attention_mask` argument). Rows at any positions run together (BLOOM;
  Doge, which adds a mask of its own made from it);
- "own": no mask at all: the model makes its masks, and its biases, from the cache's sizes and one
  query offset (SlotKVCache.get_query_offset), as transformers' caches answer, so a step's rows
  run in groups of one start (row_groups) (Falcon-RW, which folds its biases into the mask its
  forward builds; GPT-Neo, whose local attention indexes a window table by the key count).
Neither packs rows. Where none passes (the model's layers keep what the slot cache does not hold,
or it takes no cache but its own), "cache": each slot holds the cache the model's forward makes when
handed none (model_cache.py), and each row of a step runs in a forward of its own (DeepSeek-V4,
MiniMax). The first that passes is kept with the check.
"""
from __future__ import annotations

import copy
import inspect
import json

import torch

from ..hf.fields import shrunk
from ..hf.structure import find_layers
from ..hf.meta_forward import cache_kwarg
from . import packed as packed_attention
from . import states
from .expert_rows import use_expert_rows
from .gemv import use_gemv
from .kvcache import SlotKVCache
from .model_cache import ModelCaches, returned_cache

CHECK_TOL = 1e-3  # of the largest logit; fp32 agrees to ~1e-6 where the path is right
_CHECKS: dict = {}


def sliding_window(config) -> tuple[int | None, bool]:
    """(window, per-layer masks) the way transformers' mask creation decides
    (masking_utils.create_masks_for_generate): with `layer_types`, a mask per type (sliding where a
    type says so); else a `sliding_window` set means every layer slides."""
    c = config.get_text_config()
    types = getattr(c, "layer_types", None)
    if types is not None:
        # attention of another kind (compressed, sparse) needs its own masks; the recurrent layers'
        # types (linear_attention, mamba, conv, hybrid) take none from the engine
        # (GenericStep.maskless_types); chunked ones are chunked_attention's
        # indexed ones (DeepSeek-V3.2's sparse attention) take the full causal mask, their indexer's
        # keys kept by the cache (update_indexer)
        made = {"full_attention", "sliding_attention", "chunked_attention", "linear_attention", "indexed_attention"}
        other = {t for t in set(types) - made if t.endswith("attention")}
        if other:
            raise ValueError(f"{c.model_type}: layers of type {', '.join(sorted(other))} need attention masks "
                             f"tierlm's inference does not make (it makes full, sliding-window and chunked ones)")
        if "sliding_attention" in types:
            return c.sliding_window, True
        if getattr(c, "sliding_window", None) is not None and set(types) - made:
            # types of the family's own naming (Inkling's hybrid / hybrid_sliding) that its forward
            # maps to full or sliding masks: both made, as transformers' mask creation makes both
            return c.sliding_window, True
        return None, False
    if getattr(c, "sliding_window", None) is not None:
        return c.sliding_window, False
    return None, False


def _additive(mask, dtype):
    """Boolean masks as transformers' eager attention adds them to its scores: 0 where a query
    attends, the dtype's minimum where it does not (a dict of them: each; one tensor per mask)."""
    if isinstance(mask, dict):
        done: dict = {}
        return {k: None if m is None else done.setdefault(id(m), _additive(m, dtype)) for k, m in mask.items()}
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)


def chunked_attention(config) -> tuple[int | None, bool]:
    """(chunk size, per-layer masks) of chunked attention (Llama 4's: a query sees the keys of its
    own chunk of `attention_chunk_size` positions, up to itself), as transformers' mask creation
    decides: the layers whose type is chunked_attention, or every layer without `layer_types`."""
    c = config.get_text_config()
    size = getattr(c, "attention_chunk_size", None)
    types = getattr(c, "layer_types", None)
    if size is None or (types is not None and "chunked_attention" not in types):
        return None, False
    return size, types is not None


def row_groups(lens: list[int], states: bool, starts: list[int] | None = None) -> list[tuple[int, int]]:
    """The (first, end) row ranges a step runs as separate forwards: all rows at once, except
    - where layers keep recurrent states: a recurrence runs a row's every position, so a padded
      position would enter its state, and a packed row would run into the next. There, runs of
      consecutive rows of one length (decoding rows together; a prompt beside them on its own);
    - with `starts`, where the attention reads one offset for all rows from the cache (Llama 4's
      position-scaled queries): runs of rows that start at one position."""
    if not states and starts is None:
        return [(0, len(lens))]
    out, a = [], 0
    for b in range(1, len(lens) + 1):
        if b == len(lens) or (states and lens[b] != lens[a]) or (starts is not None and starts[b] != starts[a]):
            out.append((a, b))
            a = b
    return out


def reads_offset(model) -> bool:
    """Whether an attention module computes from the cache's length (one number for every row)."""
    seen = set()
    for m in packed_attention.attention_modules(model):
        if type(m) in seen:
            continue
        seen.add(type(m))
        try:
            src = inspect.getsource(type(m).forward)
            # Llama 4's position-scaled queries; Inkling's relative positions from the query offset
            if "get_seq_length(" in src or "get_query_offset(" in src:
                return True
        except (OSError, TypeError):
            pass
    return False


MASKS = ("engine", "layers", "own", "cache")


class GenericStep:
    def __init__(self, model, config, cache: SlotKVCache | ModelCaches, packed: bool = True, masks: str = "engine"):
        """masks: whose masks the steps run (one of MASKS; the check's verdict: mask_mode); "cache"
        runs on a ModelCaches, the others on a SlotKVCache."""
        if masks not in MASKS:
            raise ValueError(f"masks={masks!r}: one of {', '.join(MASKS)}")
        self.model, self.cache = model, cache
        self.states = cache.states is not None
        self.masks = masks
        self.model_caches = masks == "cache"  # each row its slot's own model-made cache, its own forward
        self.own_masks = masks in ("own", "cache")
        self.offsets = (reads_offset(model) or self.own_masks) and not self.model_caches
        types = getattr(config.get_text_config(), "layer_types", None) or []
        self.indexed_types = "indexed_attention" in types
        # packed rows only where the model's attention runs packed.rows_attention (and no layer
        # keeps a recurrent state: row_groups), nor where a sparse-attention indexer scores a row's
        # queries against its cached keys: DeepSeek-V3.2's indexer keys (cache.indexed), or, in
        # indexed_attention layers, the keys and the mask the layer is given (Kolibri 1.1's indexer
        # picks them per batch row before attention runs, so in a packed step, one batch row of every
        # row's tokens, it would score all queries against the first slot's keys)
        if self.own_masks:  # the model's masks are made for transformers' default attention: it runs
            packed_attention.use_defaults(model, config)
            self.packs = False
        else:
            self.packs = packed_attention.install(model, config, cache) and packed and not self.states \
                and not self.offsets and not cache.indexed and not self.indexed_types and masks == "engine"
        self._layer_mask = None  # "layers": the step's mask, which each decoder layer is handed
        if masks == "layers":
            for layer in find_layers(model)[1]:
                layer.register_forward_pre_hook(self._hand_mask, with_kwargs=True)
        # a model without attention (Mamba) takes no mask: its layers would apply a 4-D one as padding
        self.attends = bool(packed_attention.attention_modules(model))
        self.maskless_types = {t for t in types if t not in ("full_attention", "sliding_attention", "chunked_attention",
                                                             "indexed_attention")}
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self.cache_kw = cache_kwarg(self.base)
        self.lm_cache_kw = cache_kwarg(model)
        self.keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        # (the model's own cache and masks know its attention: no window or chunk of the engine's)
        self.window, self.sliding = (None, False) if self.model_caches else sliding_window(config)
        self.chunk, self.chunk_layers = (None, False) if self.model_caches else chunked_attention(config)
        self._row = None  # "cache": the slot of the row prepare() made ready

    def prepare(self, tokens: list[list[int]], starts: list[int], first: int = 0):
        """(ids, position ids, masks, packed) of a step of rows in slots first, first + 1, ...; the
        cache is told where each row writes."""
        lens = [len(t) for t in tokens]
        if self.model_caches:  # one row (groups): its slot's cache, positions from where it stands
            self._row = first
            self._row_cache = self.cache.take(first, starts[0], lens[0])
            ids = torch.tensor([tokens[0]], dtype=torch.long)
            return ids, torch.arange(starts[0], starts[0] + lens[0]).unsqueeze(0), None, False
        q = max(lens)
        # rows of different lengths run packed (tierlm.infer.packed): padding them would compute
        # rows x q tokens where sum(lens) are real
        packed = self.packs and len(tokens) > 1 and sum(lens) < len(tokens) * q
        if packed:
            ids = torch.tensor([sum(tokens, [])], dtype=torch.long)
        else:
            ids = torch.tensor([t + [t[-1]] * (q - len(t)) for t in tokens], dtype=torch.long)
        pos, mask = self.cache.begin_step(starts, lens, self.window, self.sliding, packed=packed, first=first,
                                          chunk=self.chunk, chunk_layers=self.chunk_layers)
        if not self.attends or self.own_masks:
            mask = None
        elif isinstance(mask, dict):  # a mask for every layer type the model looks up
            mask.update(dict.fromkeys(self.maskless_types))
            if self.states:
                # the recurrent layers' padding mask (create_recurrent_attention_mask's key), looked
                # up whatever the types are called: none, as no row is padded where states are kept
                mask.setdefault("linear_attention", None)
        if self.indexed_types:  # indexed layers look up their own key: the full causal mask
            mask = dict(mask) if isinstance(mask, dict) else {"full_attention": mask}
            mask["indexed_attention"] = mask["full_attention"]
        if mask is not None and self.model.config._attn_implementation == "eager":
            mask = _additive(mask, self.model.dtype)
        return ids, pos, mask, packed

    def logits(self, ids, pos, mask, packed: bool, lens: list[int]) -> torch.Tensor:
        """fp32 logits of each row's last token, [rows, vocab]."""
        rows = len(lens)
        at = torch.tensor(lens)
        at = at.cumsum(0) - 1 if packed else at - 1  # each row's last token (in the packed row)
        if self.model_caches:
            return self._own_cache_logits(ids, pos)
        if self.masks == "layers" and mask is not None:
            # the model builds its biases from a 2-D mask of the keys (all read: the 4-D masks,
            # handed to each layer, hide what a row must not see)
            self._layer_mask = mask
            mask = torch.ones((ids.shape[0], mask.shape[-1]), dtype=torch.long, device=ids.device)
        try:
            if self.keeps:
                # the positions some row ends at; row b's logits are those of its own
                keep, which = torch.unique(at, return_inverse=True)
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                 logits_to_keep=keep, **{self.lm_cache_kw: self.cache})
                return (out.logits[0] if packed else out.logits[torch.arange(rows), which]).float()
            out = self.base(input_ids=ids, attention_mask=mask, position_ids=pos,
                            use_cache=True, **{self.cache_kw: self.cache})
        finally:
            self.cache.segments = None  # a later forward without begin_step (perplexity) is not packed
            self._layer_mask = None
        h = out.last_hidden_state
        return self.head(h[0, at] if packed else h[torch.arange(rows), at]).float()

    def _own_cache_logits(self, ids, pos) -> torch.Tensor:
        """A row's last logits through the model's forward on its slot's own cache (None: the model
        makes one), which is kept for the row's next step."""
        slot, cache = self._row, self._row_cache
        self._row = self._row_cache = None
        if self.keeps:
            kw = {self.lm_cache_kw: cache} if cache is not None else {}
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **kw)
            logits = out.logits[:, -1]
        else:
            kw = {self.cache_kw: cache} if cache is not None else {}
            out = self.base(input_ids=ids, position_ids=pos, use_cache=True, **kw)
            logits = self.head(out.last_hidden_state[:, -1])
        made = returned_cache(out)
        if made is None:
            raise ValueError(f"{type(self.model).__name__}: its forward returned no cache")
        self.cache.keep(slot, made)
        return logits.float()

    def _hand_mask(self, module, args, kwargs):
        """A decoder layer's pre-hook ("layers"): the step's 4-D mask for the one the model made."""
        if self._layer_mask is None or "attention_mask" not in kwargs:
            return None
        return args, dict(kwargs, attention_mask=self._layer_mask)

    def groups(self, tokens: list[list[int]], starts: list[int]) -> list[tuple[int, int]]:
        """The row ranges this step runs as separate forwards (row_groups; each row alone on the
        model's own caches)."""
        if self.model_caches:
            return [(i, i + 1) for i in range(len(tokens))]
        return row_groups([len(t) for t in tokens], self.states, starts if self.offsets else None)

    @torch.no_grad()
    def __call__(self, tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        out = []
        for a, b in self.groups(tokens, starts):
            ids, pos, mask, packed = self.prepare(tokens[a:b], starts[a:b], first=a)
            out.append(self.logits(ids, pos, mask, packed, [len(t) for t in tokens[a:b]]))
        return torch.cat(out) if len(out) > 1 else out[0]

    @torch.no_grad()
    def logits_all(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of [B, T] ids without the cache (perplexity)."""
        if self.keeps:  # the model's own forward, whatever it does after its head
            return self.model(input_ids=input_ids, use_cache=False).logits.float()
        return self.head(self.base(input_ids=input_ids, use_cache=False).last_hidden_state).float()


def _verdict(model) -> tuple[str | None, bool | None, str, str | None]:
    """The check's (why or None, whether prompts may go in chunks, whose masks the steps run, why
    the engine's own failed where another mode passed) for `model`'s config, run once per config;
    (None, None, "engine", None) where no small copy of the config can be made (nothing to compare)."""
    try:
        cfg = _small_copy(model.config)
        key = (type(model), json.dumps(cfg.to_dict(), sort_keys=True, default=str))
    except Exception:  # noqa: BLE001 -- a config that cannot be copied small is not checked
        return None, None, "engine", None
    if key not in _CHECKS:
        _CHECKS[key] = _check(type(model), cfg)
    return _CHECKS[key]


def _small_copy(config):
    """The smallest copy of `config` (hf.fields.shrunk, every kind of layer) that transformers
    builds: two layers, or more where fewer cannot be built (Zamba's hybrid layers share one block,
    which transformers ties only where two hybrid layers are kept). The two-layer copy where none
    builds (the check then says it could not run it)."""
    from transformers import AutoModelForCausalLM
    key = (type(config).__name__, config.to_json_string(use_diff=False))
    if key in _COPIES:
        return copy.deepcopy(_COPIES[key])
    _COPIES[key] = cfg = _smallest_built(config, AutoModelForCausalLM)
    return copy.deepcopy(cfg)


_COPIES: dict[tuple, object] = {}


def _smallest_built(config, auto):
    first = shrunk(config, layers=2, every_kind=True)
    tried = {first.num_hidden_layers}
    for layers in range(2, min(getattr(config, "num_hidden_layers", None) or 2, 8) + 1):
        cfg = first if layers == 2 else shrunk(config, layers=layers, every_kind=True)
        if cfg.num_hidden_layers in tried and layers > 2:
            continue
        tried.add(cfg.num_hidden_layers)
        try:
            with torch.device("meta"):
                auto.from_config(copy.deepcopy(cfg))
            return cfg
        except Exception:  # noqa: BLE001 -- the family's own modules refuse this copy: one more layer
            continue
    return first


def check(model) -> str | None:
    """Why this path does not compute what transformers computes for `model`'s family (on a tiny
    copy), or None; None too where no tiny copy can be made and run (nothing to compare)."""
    return _verdict(model)[0]


def continues_prompts(model) -> bool:
    """Whether a prompt fed in chunks (a step's `step_tokens` at a time) computes what it computes
    fed whole: true of attention, and of the recurrent layers whose prompt path starts from the
    state kept (Gated DeltaNet's); Mamba's restarts from zero, so its prompts must go in one step.
    Checked on the tiny copy (`check` runs first); False where no copy could be checked."""
    return bool(_verdict(model)[1])


def mask_mode(model) -> str:
    """Whose masks the steps run (GenericStep's `masks`): "engine" unless the engine's failed the
    check on the tiny copy and "layers", "own" or "cache" passed it."""
    return _verdict(model)[2]


def engine_failure(model) -> str | None:
    """Why the engine's own masks and KV cache failed the check where another mode passed it."""
    return _verdict(model)[3]


def _check(cls, cfg) -> tuple[str | None, bool | None, str, str | None]:
    """(why the step differs from transformers' or None, whether prompts may go in chunks: None
    where the copy could not be run, whose masks the steps run, why the engine's own failed where
    they did): the engine's masks first, then, where they fail, each other mode in turn (MASKS)."""
    from transformers import AutoModelForCausalLM
    cfg._attn_implementation = "eager"  # transformers' reference attention (soft-capping and all)
    # two rows of different lengths (a packed prefill), then a decode step of both; past the
    # sliding windows that shrunk keeps small
    n = max(8, min(2 * (getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None) or 0), 24))
    seqs = [n, n // 2]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        try:
            # built in fp32 (buffers made at init too: MiniMax's decay tables, rounded to bf16 in a bf16
            # config, part its block and step paths by 1e-3)
            tiny = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).float().eval()
            with torch.no_grad():
                for p in tiny.parameters():  # wide weights, so a missed term moves the logits
                    p.copy_(torch.randn(p.shape) * 0.3 if p.dim() > 1 else torch.rand(p.shape) + 0.5)
            ids = [torch.randint(0, cfg.vocab_size, (s + 1,)).tolist() for s in seqs]
            with torch.no_grad():
                ref = [tiny(torch.tensor([t])).logits[0, -2:].float() for t in ids]
        except Exception:  # noqa: BLE001 -- a class transformers cannot run small is not checked
            return None, None, "engine", None
    ref = torch.stack(ref)  # [rows, 2 (after the prompt, after one more token), vocab]
    cached = _cached_reference(tiny, ids)
    use_gemv(tiny)  # the engine's linear modules, as it runs them (gemv.use_gemv swaps some subclasses)
    use_expert_rows(tiny)  # ... and its experts' implementation
    first = None
    for masks in MASKS:
        # each mode on its own copy: a failed one leaves its hooks and attention functions behind
        # ("layers" hands each layer a mask that is not the model's own)
        why, chunks = _compare(copy.deepcopy(tiny), cfg, ids, ref, masks=masks, cached=cached)
        if why is None:
            return None, chunks, masks, first[0] if first else None
        first = first or (why, chunks)
    return first[0], first[1], "engine", first[0]  # (why the engine's masks fail)


def _cached_reference(tiny, ids) -> torch.Tensor | None:
    """transformers' own decoding of each row: its prompt, then one token through the cache the
    forward made (what `generate` runs), [rows, 2, vocab]; None where the forward takes no cache.
    Where a layer picks keys or experts by top-k, a tie broken the other way by rounding (the
    MLP over six tokens against over one) parts this from the forward over the whole sequence
    (dots3-note's tiny copy: 3e-2), and a step equal to either equals transformers."""
    try:
        rows = []
        with torch.no_grad():
            for t in ids:
                a = tiny(torch.tensor([t[:-1]]), use_cache=True)
                b = tiny(torch.tensor([t[-1:]]), use_cache=True, **{cache_kwarg(tiny): returned_cache(a)})
                rows.append(torch.stack([a.logits[0, -1], b.logits[0, -1]]).float())
        return torch.stack(rows)
    except Exception:  # noqa: BLE001 -- compared with the whole-sequence forward alone
        return None


def _compare(tiny, cfg, ids, ref, masks: str, cached=None) -> tuple[str | None, bool]:
    """(why the steps' logits differ from `ref` (and from `cached`, transformers' own decoding,
    where given) or None, whether prompts may go in chunks)."""
    seqs = [len(t) - 1 for t in ids]
    n = seqs[0]
    try:
        attn = packed_attention.attention_modules(tiny)
        shapes = states.probe(cfg, bool(attn)) if states.keeps_states(tiny) else None
        kv_layers = states.kv_layers(attn, cfg) if shapes else None  # as the engine makes it
        cache = ModelCaches(len(seqs), n + 1, 0) if masks == "cache" else \
            SlotKVCache(cfg, len(seqs), n + 1, torch.float32, states=shapes, kv_layers=kv_layers)
        step = GenericStep(tiny, cfg, cache, masks=masks)
        first = step([t[:-1] for t in ids], [0] * len(seqs))
        second = step([t[-1:] for t in ids], seqs)
    except Exception as e:  # noqa: BLE001 -- transformers ran it; ours did not
        return f"its forward fails on tierlm's KV cache and masks ({type(e).__name__}: {e})", True
    got = torch.stack([first, second], 1)
    scale = max(ref.abs().max().item(), 1e-6)
    err = (got - ref).abs().max().item() / scale
    if cached is not None:
        err = min(err, (got - cached).abs().max().item() / scale)
    if not err <= CHECK_TOL and tiny.config._attn_implementation == "sdpa":
        # the steps run the model's own SDPA branch (packed.install: Falcon's), which transformers'
        # eager path may not equal (Falcon-RW's eager attention adds its ALiBi twice, once in its
        # scores and once in the mask its forward built; its SDPA branch, transformers' default for
        # it, once): compared with transformers' forward through that branch
        with torch.no_grad():
            ref = torch.stack([tiny(torch.tensor([t])).logits[0, -2:].float() for t in ids])
        scale = max(ref.abs().max().item(), 1e-6)
        err = (got - ref).abs().max().item() / scale
    if not err <= CHECK_TOL:
        return (f"on a small copy of the model its logits through tierlm's KV cache and masks differ from "
                f"transformers' by {err:.1e} of the largest"), True
    if not shapes and masks != "cache":
        return None, True
    # the first row's prompt again, in two chunks (its slot's states, or its own cache, start anew)
    t, h = ids[0], n // 2
    try:
        step([t[:h]], [0])
        chunked = step([t[h:-1]], [h])[0]
    except Exception:  # noqa: BLE001 -- the layer cannot continue a prompt: whole prompts only
        return None, False
    return None, bool((chunked - ref[0, 0]).abs().max().item() / scale <= CHECK_TOL)
