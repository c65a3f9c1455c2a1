"""A step through transformers' own modules, and the check that it computes what they compute.

`GenericStep` runs one step of rows (each row a KV-cache slot) through the model's forward: the
engine's packed rows or padded ones, its boolean masks (sliding windows decided as transformers'
mask creation decides), and the logits through the model's own forward where it keeps chosen
positions, so what a family does after its head (Gemma2's final soft-capping, Granite's logits
scaling) is its code, not ours.

`check` runs the same step on a tiny random copy of the model (its class and options, small
shapes: hf.fields.shrunk) and compares every logit with transformers' forward over each whole
sequence: a family whose attention or position code takes something this path does not give it
(Falcon-RW's ALiBi builds its biases from a 2-D padding mask) is refused by name instead of
generating wrong tokens. Kept per config.
"""
from __future__ import annotations

import inspect
import json

import torch

from ..hf.fields import shrunk
from . import packed as packed_attention
from .expert_rows import use_expert_rows
from .gemv import use_gemv
from .kvcache import SlotKVCache, cache_kwarg

CHECK_TOL = 1e-3  # of the largest logit; fp32 agrees to ~1e-6 where the path is right
_CHECKS: dict = {}


def sliding_window(config) -> tuple[int | None, bool]:
    """(window, per-layer masks) the way transformers' mask creation decides
    (masking_utils.create_masks_for_generate): with `layer_types`, a mask per type (sliding where a
    type says so); else a `sliding_window` set means every layer slides."""
    c = config.get_text_config()
    types = getattr(c, "layer_types", None)
    if types is not None:
        other = set(types) - {"full_attention", "sliding_attention"}
        if other:
            raise ValueError(f"{c.model_type}: layers of type {', '.join(sorted(other))} need attention masks "
                             f"tierlm's inference does not make (it makes full and sliding-window ones)")
        if "sliding_attention" in types:
            return c.sliding_window, True
        return None, False
    if getattr(c, "sliding_window", None) is not None:
        return c.sliding_window, False
    if getattr(c, "attention_chunk_size", None) is not None:
        raise ValueError(f"{c.model_type}: chunked attention (attention_chunk_size) needs attention masks "
                         f"tierlm's inference does not make")
    return None, False


class GenericStep:
    def __init__(self, model, config, cache: SlotKVCache, packed: bool = True):
        self.model, self.cache = model, cache
        # packed rows only where the model's attention runs packed.rows_attention
        self.packs = packed_attention.install(model, config, cache) and packed
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self.cache_kw = cache_kwarg(self.base)
        self.lm_cache_kw = cache_kwarg(model)
        self.keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.window, self.sliding = sliding_window(config)

    def prepare(self, tokens: list[list[int]], starts: list[int]):
        """(ids, position ids, masks, packed) of a step; the cache is told where each row writes."""
        lens = [len(t) for t in tokens]
        q = max(lens)
        # rows of different lengths run packed (tierlm.infer.packed): padding them would compute
        # rows x q tokens where sum(lens) are real
        packed = self.packs and len(tokens) > 1 and sum(lens) < len(tokens) * q
        if packed:
            ids = torch.tensor([sum(tokens, [])], dtype=torch.long)
        else:
            ids = torch.tensor([t + [t[-1]] * (q - len(t)) for t in tokens], dtype=torch.long)
        pos, mask = self.cache.begin_step(starts, lens, self.window, self.sliding, packed=packed)
        return ids, pos, mask, packed

    def logits(self, ids, pos, mask, packed: bool, lens: list[int]) -> torch.Tensor:
        """fp32 logits of each row's last token, [rows, vocab]."""
        rows = len(lens)
        at = torch.tensor(lens)
        at = at.cumsum(0) - 1 if packed else at - 1  # each row's last token (in the packed row)
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
        h = out.last_hidden_state
        return self.head(h[0, at] if packed else h[torch.arange(rows), at]).float()

    @torch.no_grad()
    def __call__(self, tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        ids, pos, mask, packed = self.prepare(tokens, starts)
        return self.logits(ids, pos, mask, packed, [len(t) for t in tokens])

    @torch.no_grad()
    def logits_all(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of [B, T] ids without the cache (perplexity)."""
        if self.keeps:  # the model's own forward, whatever it does after its head
            return self.model(input_ids=input_ids, use_cache=False).logits.float()
        return self.head(self.base(input_ids=input_ids, use_cache=False).last_hidden_state).float()


def check(model) -> str | None:
    """Why this path does not compute what transformers computes for `model`'s family (on a tiny
    copy), or None; None too where no tiny copy can be made and run (nothing to compare)."""
    try:
        cfg = shrunk(model.config, layers=2, every_kind=True)
        key = (type(model), json.dumps(cfg.to_dict(), sort_keys=True, default=str))
    except Exception:  # noqa: BLE001 -- a config that cannot be copied small is not checked
        return None
    if key not in _CHECKS:
        _CHECKS[key] = _check(type(model), cfg)
    return _CHECKS[key]


def _check(cls, cfg) -> str | None:
    from transformers import AutoModelForCausalLM
    cfg._attn_implementation = "eager"  # transformers' reference attention (soft-capping and all)
    # two rows of different lengths (a packed prefill), then a decode step of both; past the
    # sliding windows that shrunk keeps small
    n = max(8, min(2 * (getattr(cfg, "sliding_window", None) or 0), 24))
    seqs = [n, n // 2]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        try:
            tiny = AutoModelForCausalLM.from_config(cfg).float().eval()
            with torch.no_grad():
                for p in tiny.parameters():  # wide weights, so a missed term moves the logits
                    p.copy_(torch.randn(p.shape) * 0.3 if p.dim() > 1 else torch.rand(p.shape) + 0.5)
            ids = [torch.randint(0, cfg.vocab_size, (s + 1,)).tolist() for s in seqs]
            with torch.no_grad():
                ref = [tiny(torch.tensor([t])).logits[0, -2:].float() for t in ids]
        except Exception:  # noqa: BLE001 -- a class transformers cannot run small is not checked
            return None
    ref = torch.stack(ref)  # [rows, 2 (after the prompt, after one more token), vocab]
    use_gemv(tiny)  # the engine's linear modules, as it runs them (gemv.use_gemv swaps some subclasses)
    use_expert_rows(tiny)  # ... and its experts' implementation
    step = GenericStep(tiny, cfg, SlotKVCache(cfg, len(seqs), n + 1, torch.float32))
    try:
        first = step([t[:-1] for t in ids], [0] * len(seqs))
        second = step([t[-1:] for t in ids], seqs)
    except Exception as e:  # noqa: BLE001 -- transformers ran it; ours did not
        return f"its forward fails on tierlm's KV cache and masks ({type(e).__name__}: {e})"
    err = (torch.stack([first, second], 1) - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    if not err <= CHECK_TOL:
        return (f"on a small copy of the model its logits through tierlm's KV cache and masks differ from "
                f"transformers' by {err:.1e} of the largest")
    return None
