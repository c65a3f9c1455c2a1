"""Decode steps of llama-family models without transformers' per-token Python.

A decode step multiplies every weight by one row per sequence: ~2 GB for TinyLlama-1.1B in bf16,
~70 ms at this machine's memory speed. transformers' modeling code adds ~30 ms of small ops around
the products (docs/inference.md at a2b1c1e, "Where decode time goes"): decoder-layer wrappers, kwargs
plumbing, attention dispatch, a dtype conversion before and after every product. This module runs
the decoder layer's arithmetic for steps where every row brings one token:

- activations stay fp32 between the products (each of our kernels takes fp32 x and returns fp32
  y, so nothing is converted around them; a bf16 model's hidden states are then rounded less than
  in transformers' forward, not more);
- a layer's q, k and v, and its gate and up, are one kernel call each (`native.KeptCall`): one
  parallel region instead of three or two, the outputs side by side in one tensor;
- the RMSNorm before attention and before the MLP is done by the kernel call that multiplies its
  result (it prepares its x anyway: 19 against 35-47 us in torch ops);
- rotary embedding (transformers' own rotary module for cos/sin, so every rope variant is theirs;
  queries and keys rotated together), the KV cache update and attention (one query per row: the
  heads sharing a KV head become its queries, as transformers packs them) are a few torch ops.

Weights are read from the modules at each call, so streamed layers (installed by the stream just
before) and resident ones take the same path. Where our kernels do not apply (fp32 weights, int4
in PyTorch's layout, no C compiler) each product is the module's own forward, so an fp32 model computes what
transformers computes (tests/infer/test_lean.py compares the logits of every decode step).
Prefill, and any step where a row brings several tokens, keeps transformers' forward.

Where our kernels take a layer's weights and rows, the whole layer is one C call instead
(fused.py: the same products, no torch ops between them); the per-product `_layer` below runs
otherwise, and with `InferConfig(fused=False)`.

Supported: llama-like layers (q/k/v/o projections, RMSNorms before attention and MLP, a gated
MLP): llama, mistral, qwen2, and
- qwen3's per-head q and k RMSNorms (after the projections, before the rotation);
- gemma's norms, which scale by 1 + weight in fp32 (the kernels take a flag, native.NORM_ONE_PLUS),
  its embeddings scaled by sqrt(hidden) (transformers' embedding module does it, in the embedding
  dtype, so `self.embed` here does too) and its tanh-approximated gelu (the MLP's own act_fn; in
  the fused layer, kernels/layer.c's).
What a family computes is found from its modules, not from a list of model types: the norms'
formula and the activation by running them on probes (fused.norm_of, fused.activation), q/k norms
by their presence. Families that look like llama by their modules but compute something else
(granite's multipliers, an embedding scaled in the model's forward) are caught by a self-check at
build: a tiny copy of the model's config (its classes and options) with random fp32 weights,
whose logits of each decode step on this path must equal transformers' forward to fp32 noise
(`self_check`; the fused C layer is checked the same way, and kept off where it differs). Anything
else (gemma2's and olmo2's norms after blocks, phi3's fused projections, gpt2, tensor
parallelism) gets None from `LeanDecoder.build`, and `LeanDecoder.refusal` says why.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..hf.fields import shrunk
from . import native
from .fused import FusedLayer, FusedStack, Norm, StepArgs, norm_of
from .gemv import UPCAST_MIN_ROWS, bf16_matmul_is_slow
from .kvcache import SlotKVCache
from .quant import NATIVE_MAX_ROWS, QLinear

# the modules a decoder layer, its attention and its MLP may have: any other is maths this path
# does not do (gemma2's norms after blocks, phi3's fused qkv_proj, ...)
LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTN_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
QK_NORMS = {"q_norm", "k_norm"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
# the self-check: logits of a tiny copy of the model, lean against transformers, fp32; fp32 sums in
# another order differ by ~1e-6 of the logits' size; a missed multiplier, soft-cap or norm by more
# than 1e-3
CHECK_TOL = 1e-4


class Products:
    """The products of one x with a few linear modules (a layer's q, k, v; its gate and up), the
    RMSNorm before them folded into the same call."""

    def __init__(self, mods, dtype: torch.dtype):
        self.mods, self.dtype = list(mods), dtype
        self.call = native.KeptCall()
        if all(isinstance(m, QLinear) and m.mode == "int8" for m in self.mods):
            self.kind = "int8"
        elif all(isinstance(m, QLinear) and m.layout == "tierlm" and m.group == self.mods[0].group
                 for m in self.mods):
            self.kind = "int4"
        elif dtype == torch.bfloat16 and not any(isinstance(m, QLinear) for m in self.mods):
            # (the weights are in the compute dtype; a streamed layer's are not installed yet)
            self.kind = "bf16"
        else:
            self.kind = "module"

    def __call__(self, x: torch.Tensor, norm: Norm | None = None) -> torch.Tensor:
        """x fp32 [rows, K] (with `norm`, norm(x)) -> fp32 [rows, sum of the modules' outputs]."""
        rows = x.shape[0]
        mine = native.available() and (
            (self.kind in ("int8", "int4") and rows <= NATIVE_MAX_ROWS) or
            (self.kind == "bf16" and (rows == 1 or (rows < UPCAST_MIN_ROWS and bf16_matmul_is_slow()))))
        if mine:
            nw = None if norm is None else norm.args()
            if self.kind == "int8":
                y = self.call(x, [m.qweight for m in self.mods], [m.scales for m in self.mods], norm=nw)
            elif self.kind == "int4":
                y = self.call(x, [m.qweight for m in self.mods], [m.scales for m in self.mods], norm=nw,
                              group=self.mods[0].group)
            else:
                y = self.call(x, [m.weight for m in self.mods], norm=nw)
        else:
            if norm is not None:
                x = norm(x)
            xc = x.to(self.dtype)
            ys = [m(xc).float() for m in self.mods]
            return ys[0] if len(ys) == 1 else torch.cat(ys, -1)
        biases = [m.bias for m in self.mods]
        if all(b is None for b in biases):
            return y
        return y + torch.cat([torch.zeros(m.out_features) if b is None else b.float() for m, b in zip(self.mods, biases)])


def layer_norms(layer, hidden: int) -> tuple:
    """(before attention, before the MLP, q's, k's) of a decoder layer as Norms (q's and k's None
    where the layer has none; any None where a norm is of a kind we do not compute)."""
    a = layer.self_attn
    qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    return (norm_of(layer.input_layernorm, hidden), norm_of(layer.post_attention_layernorm, hidden),
            None if qn is None else norm_of(qn, a.head_dim), None if kn is None else norm_of(kn, a.head_dim))


def structure_refusal(model) -> str | None:
    """Why the model's modules are not what this path computes, or None: names of modules only;
    whether their maths is ours is then checked on numbers (LeanDecoder.refusal)."""
    base = model.base_model
    missing = [a for a in ("embed_tokens", "norm", "rotary_emb", "layers") if not hasattr(base, a)]
    if missing:
        return f"{type(base).__name__} has no {', '.join(missing)}"
    hidden = model.config.hidden_size
    if norm_of(base.norm, hidden) is None:
        return f"the final norm ({type(base.norm).__name__}) is not an RMSNorm"
    for layer in base.layers:
        parts = {n for n, _ in layer.named_children()}
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if parts != LAYER_PARTS or attn is None or mlp is None:
            extra, lack = sorted(parts - LAYER_PARTS), sorted(LAYER_PARTS - parts)
            return f"{type(layer).__name__} " + "; ".join(
                ([f"has {', '.join(extra)}"] if extra else []) + ([f"has no {', '.join(lack)}"] if lack else []))
        a_parts, m_parts = {n for n, _ in attn.named_children()}, {n for n, _ in mlp.named_children()}
        if not (ATTN_PARTS <= a_parts <= ATTN_PARTS | QK_NORMS) or (a_parts & QK_NORMS and not QK_NORMS <= a_parts):
            return f"{type(attn).__name__} has {', '.join(sorted(a_parts))}: not q/k/v/o projections (and q/k norms)"
        if not MLP_PARTS - {"act_fn"} <= m_parts <= MLP_PARTS or not callable(getattr(mlp, "act_fn", None)):
            return f"{type(mlp).__name__} has {', '.join(sorted(m_parts))}: not a gated MLP"
        if list(layer._parameters) or list(attn._parameters) or list(mlp._parameters):
            return f"{type(layer).__name__} has parameters outside its modules"
        norms = layer_norms(layer, hidden)
        if None in norms[:2]:
            return f"{type(layer.input_layernorm).__name__} is not an RMSNorm (of weight or 1 + weight)"
        if a_parts & QK_NORMS and None in norms[2:]:
            return (f"q/k norms ({type(attn.q_norm).__name__}) that are not RMSNorms over each head "
                    f"of {attn.head_dim}")
    return None


def model_refusal(model) -> str | None:
    """Why this model's decode steps cannot run on the lean path, or None: its modules
    (structure_refusal), then their maths against transformers' on a tiny copy (self_check)."""
    return structure_refusal(model) or self_check(model)[0]


_CHECKS: dict = {}


def self_check(model) -> tuple[str | None, bool]:
    """(why the lean path does not compute what transformers computes for this model's family,
    or None; whether the fused C layer does too). Run on a tiny copy of the model's config (its
    classes and options: multipliers, soft-capping, norms, embedding scale; fields.shrunk) with
    random fp32 weights: the logits of each decode step, one token a step through the KV cache,
    against the causal LM's own forward over the whole sequence (its head, and what follows the
    head, too). This catches what the module names do not show: granite's multipliers, a norm
    applied elsewhere, an embedding scaled outside the embedding module, logits scaled or
    soft-capped after the head. Kept per config."""
    import json

    cfg = shrunk(model.config, layers=2, every_kind=True)
    try:
        key = (type(model), json.dumps(cfg.to_dict(), sort_keys=True, default=str))
    except (TypeError, ValueError):
        key = None
    if key is not None and key in _CHECKS:
        return _CHECKS[key]
    out = _self_check(type(model), cfg)
    if key is not None:
        _CHECKS[key] = out
    return out


def _self_check(cls, cfg) -> tuple[str | None, bool]:
    n = 6
    cfg._attn_implementation = "eager"  # transformers' reference attention (soft-capping and all)
    if getattr(cfg, "sliding_window", None):  # windows past the probe: the masks are the engine's
        cfg.sliding_window = max(cfg.sliding_window, 2 * n)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        try:
            tiny = cls(cfg).float().eval()
        except Exception as e:  # noqa: BLE001 -- a class that cannot be built small is not checked
            return f"its self-check could not build a small {cls.__name__}: {e}", False
        with torch.no_grad():
            for name, p in tiny.named_parameters():
                # wide weights (so a missed factor moves the logits), norm weights and biases away
                # from 0 and 1 (so weight and 1 + weight, and a missed bias, differ)
                p.copy_(torch.randn(p.shape) * 0.3 if p.dim() > 1 else torch.rand(p.shape) + 0.5)
        ids = torch.randint(0, cfg.vocab_size, (1, n))
    why = structure_refusal(tiny)
    if why:
        return why, False
    with torch.no_grad():  # the model's own logits: what a family does after its head (scaling, soft-capping) too
        ref = tiny(input_ids=ids, use_cache=False).logits[0].float()
    scale = ref.abs().max().item()
    results = []
    for fused in (False, True):
        dec = LeanDecoder(tiny, torch.float32, None, {}, fused=fused)
        if fused and (dec.fused is None or not dec.fused[0].ready(1)):
            results.append(None)
            break
        cache = SlotKVCache(cfg, 1, n, torch.float32)
        got = []
        for t in range(n):
            pos, mask = cache.begin_step([t], [1])
            got.append(dec.logits(ids[:, t:t + 1], pos, mask, cache)[0])
        results.append((torch.stack(got) - ref).abs().max().item() / scale)
    if not results[0] <= CHECK_TOL:
        return (f"the lean step's logits differ from transformers' by {results[0]:.2g} of their size on a "
                f"small {cls.__name__} (maths outside its modules, or in a form it does not compute)"), False
    return None, results[1] is not None and results[1] <= CHECK_TOL


class LeanDecoder:
    def __init__(self, model, dtype: torch.dtype, stream, streamed: dict[int, int], fused: bool = True):
        base = model.base_model
        hidden = model.config.hidden_size
        self.embed, self.rotary = base.embed_tokens, base.rotary_emb
        self.norm = norm_of(base.norm, hidden)
        self.head = Products([model.get_output_embeddings()], dtype)
        self.layers, self.norms = [], []
        types = getattr(model.config, "layer_types", None)
        for i, layer in enumerate(base.layers):
            a, m = layer.self_attn, layer.mlp
            self.layers.append((layer, Products([a.q_proj, a.k_proj, a.v_proj], dtype), Products([a.o_proj], dtype),
                                Products([m.gate_proj, m.up_proj], dtype), Products([m.down_proj], dtype),
                                bool(types) and types[i] == "sliding_attention"))
            self.norms.append(layer_norms(layer, hidden))
        self.stream = stream
        self.streamed = streamed  # decoder layer position -> block index the stream knows it by
        # each layer in one C call where the kernels take its weights and maths (fused.py)
        self.fused = [FusedLayer(layer, model.config, resident=i not in streamed) for i, layer in enumerate(base.layers)] \
            if fused and native.available() else None
        if self.fused is not None and any(f.why for f in self.fused):
            self.fused = None
        # no layer streamed: every layer in one call where all of them are ready (fused.FusedStack)
        self.stack = FusedStack(self.fused, [lay[-1] for lay in self.layers]) \
            if self.fused is not None and not streamed else None
        self._scratch: dict = {}

    @staticmethod
    def refusal(engine) -> str | None:
        """Why decode steps of this engine's model cannot run on the lean path (human-readable),
        or None where they can: the modules (structure_refusal), then their maths against
        transformers' on a tiny copy (self_check)."""
        if engine.tp is not None:
            return "tensor parallelism"
        return model_refusal(engine.model)

    @classmethod
    def build(cls, engine) -> "LeanDecoder | None":
        """The lean path for this engine's model, or None where transformers' forward must run
        (`refusal` says why)."""
        if cls.refusal(engine) is not None:
            return None
        streamed = {}
        if engine.stream:
            layer_blocks = [b for b in engine.blocks if b.kind == "layer"]
            streamed = {pos: b.index for pos, b in enumerate(layer_blocks) if b.index in engine.stream.layer_bytes}
        # the fused C layer only where it computed the tiny copy's logits too
        fused = engine.cfg.fused and self_check(engine.model)[1]
        return cls(engine.model, engine.dtype, engine.stream, streamed, fused=fused)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, pos: torch.Tensor, mask, cache) -> torch.Tensor:
        """ids, pos [B, 1]; mask [B, 1, 1, L] (or {"full_attention", "sliding_attention"});
        returns fp32 logits [B, vocab]."""
        x = self.embed(ids).float()  # (Gemma's scale by sqrt(hidden) is the embedding module's)
        cos, sin = self.rotary(x, pos)  # [B, 1, head dim]: broadcast over the heads
        half = sin.shape[-1] // 2
        folded = None  # the per-product layers' sin (the fused ones rotate with sin itself)
        x = x[:, 0].contiguous()
        rows = x.shape[0]
        if self.stack is not None and all(f.ready(rows) for f in self.fused):
            self.stack(x, StepArgs(cos, sin, mask, cache, self._scratch), cache)
            cache.note_read(rows, 0, layers=len(self.layers))
            return self.head(x, norm=self.norm)
        step = None
        for i, (layer, qkv, o, gate_up, down, sliding) in enumerate(self.layers):
            blk = self.streamed.get(i)
            if blk is not None:
                self.stream.acquire(blk)
            if self.fused is not None and self.fused[i].ready(x.shape[0]):
                if step is None:
                    step = StepArgs(cos, sin, mask, cache, self._scratch)
                self.fused[i](x, step, sliding, cache.k[i], cache.v[i])
                cache.note_read(x.shape[0], i)
            else:
                if folded is None:
                    # rotate_half(x) * sin == roll(x, half) * sin with the first half of sin negated
                    folded = torch.cat((-sin[..., :half], sin[..., half:]), -1)
                m = mask if not isinstance(mask, dict) else mask["sliding_attention" if sliding else "full_attention"]
                x = _layer(layer, i, x, cos, folded, half, m, cache, qkv, o, gate_up, down, self.norms[i])
            if blk is not None:
                self.stream.release(blk)
        return self.head(x, norm=self.norm)


def _layer(layer, i, x, cos, sin, half, mask, cache, qkv, o_proj, gate_up, down, norms=None):
    attn = layer.self_attn
    b, hd, kvh = x.shape[0], attn.head_dim, cache.k[i].shape[1]
    ln1, ln2, qn, kn = norms or layer_norms(layer, x.shape[1])
    y = qkv(x, norm=ln1)
    nqk = y.shape[1] - kvh * hd
    qk = y[:, :nqk].view(b, -1, hd)  # the query and key heads, rotated together
    if qn is not None:  # qwen3: each query and key head RMS-normalised before the rotation
        qk = torch.cat((qn(qk[:, :-kvh]), kn(qk[:, -kvh:])), 1)
    qk = qk * cos + torch.roll(qk, half, -1) * sin
    q, k = qk[:, :-kvh], qk[:, -kvh:]
    v = y[:, nqk:].view(b, kvh, hd)
    kc, vc = cache.update(k[:, :, None], v[:, :, None], i)
    # one query per row: the heads sharing a KV head become that head's queries
    q = q.reshape(b, kvh, -1, hd).to(kc.dtype)
    att = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=attn.scaling)
    x = x + o_proj(att.reshape(b, -1).float())
    gu = gate_up(x, norm=ln2)
    inter = gu.shape[1] // 2
    return x + down(layer.mlp.act_fn(gu[:, :inter]) * gu[:, inter:])
