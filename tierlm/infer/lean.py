"""Decode steps of llama-family models without transformers' per-token Python.

A decode step multiplies every weight by one row per sequence: ~2 GB for TinyLlama-1.1B in bf16,
~70 ms at this machine's memory speed. transformers' modeling code adds ~30 ms of small ops around
the products (docs/inference.md, "Where decode time goes"): decoder-layer wrappers, kwargs
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

Supported: llama, mistral, qwen2 (q/k/v/o projections, RMSNorms before attention and MLP, a gated
MLP). Anything else (gpt2, tensor parallelism, q/k norms) gets None from `LeanDecoder.build`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native
from .fused import FusedLayer, FusedStack, StepArgs
from .gemv import UPCAST_MIN_ROWS, bf16_matmul_is_slow
from .quant import NATIVE_MAX_ROWS, QLinear

ARCHS = ("llama", "mistral", "qwen2")


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

    def __call__(self, x: torch.Tensor, norm=None) -> torch.Tensor:
        """x fp32 [rows, K] (with `norm`, an RMSNorm module, norm(x)) -> fp32 [rows, sum of the
        modules' outputs]."""
        rows = x.shape[0]
        mine = native.available() and (
            (self.kind in ("int8", "int4") and rows <= NATIVE_MAX_ROWS) or
            (self.kind == "bf16" and (rows == 1 or (rows < UPCAST_MIN_ROWS and bf16_matmul_is_slow()))))
        if mine:
            nw = None if norm is None else (norm.weight, norm.variance_epsilon)
            if self.kind == "int8":
                y = self.call(x, [m.qweight for m in self.mods], [m.scales for m in self.mods], norm=nw)
            elif self.kind == "int4":
                y = self.call(x, [m.qweight for m in self.mods], [m.scales for m in self.mods], norm=nw,
                              group=self.mods[0].group)
            else:
                y = self.call(x, [m.weight for m in self.mods], norm=nw)
        else:
            if norm is not None:
                x = _rms(x, norm)
            xc = x.to(self.dtype)
            ys = [m(xc).float() for m in self.mods]
            return ys[0] if len(ys) == 1 else torch.cat(ys, -1)
        biases = [m.bias for m in self.mods]
        if all(b is None for b in biases):
            return y
        return y + torch.cat([torch.zeros(m.out_features) if b is None else b.float() for m, b in zip(self.mods, biases)])


class LeanDecoder:
    def __init__(self, model, dtype: torch.dtype, stream, streamed: dict[int, int], fused: bool = True):
        base = model.base_model
        self.embed, self.norm, self.rotary = base.embed_tokens, base.norm, base.rotary_emb
        self.head = Products([model.get_output_embeddings()], dtype)
        self.layers = []
        types = getattr(model.config, "layer_types", None)
        for i, layer in enumerate(base.layers):
            a, m = layer.self_attn, layer.mlp
            self.layers.append((layer, Products([a.q_proj, a.k_proj, a.v_proj], dtype), Products([a.o_proj], dtype),
                                Products([m.gate_proj, m.up_proj], dtype), Products([m.down_proj], dtype),
                                bool(types) and types[i] == "sliding_attention"))
        self.stream = stream
        self.streamed = streamed  # decoder layer position -> block index the stream knows it by
        # each layer in one C call where the kernels take its weights (fused.py)
        self.fused = [FusedLayer(layer, model.config, resident=i not in streamed) for i, layer in enumerate(base.layers)] \
            if fused and FusedLayer.supports(model.config) else None
        # no layer streamed: every layer in one call where all of them are ready (fused.FusedStack)
        self.stack = FusedStack(self.fused, [lay[-1] for lay in self.layers]) \
            if self.fused is not None and not streamed else None
        self._scratch: dict = {}

    @classmethod
    def build(cls, engine) -> "LeanDecoder | None":
        """The lean path for this engine's model, or None where transformers' forward must run."""
        cfg = engine.config
        if cfg.model_type not in ARCHS or engine.tp is not None:
            return None
        base = engine.model.base_model
        if not all(hasattr(base, a) for a in ("embed_tokens", "norm", "rotary_emb", "layers")):
            return None
        for layer in base.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None or hasattr(attn, "q_norm") or not hasattr(mlp, "gate_proj"):
                return None
        streamed = {}
        if engine.stream:
            layer_blocks = [b for b in engine.blocks if b.kind == "layer"]
            streamed = {pos: b.index for pos, b in enumerate(layer_blocks) if b.index in engine.stream.layer_bytes}
        return cls(engine.model, engine.dtype, engine.stream, streamed, fused=engine.cfg.fused)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, pos: torch.Tensor, mask, cache) -> torch.Tensor:
        """ids, pos [B, 1]; mask [B, 1, 1, L] (or {"full_attention", "sliding_attention"});
        returns fp32 logits [B, vocab]."""
        x = self.embed(ids).float()
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
                x = _layer(layer, i, x, cos, folded, half, m, cache, qkv, o, gate_up, down)
            if blk is not None:
                self.stream.release(blk)
        return self.head(x, norm=self.norm)


def _layer(layer, i, x, cos, sin, half, mask, cache, qkv, o_proj, gate_up, down):
    attn = layer.self_attn
    b, hd, kvh = x.shape[0], attn.head_dim, cache.k[i].shape[1]
    y = qkv(x, norm=layer.input_layernorm)
    nqk = y.shape[1] - kvh * hd
    qk = y[:, :nqk].view(b, -1, hd)  # the query and key heads, rotated together
    qk = qk * cos + torch.roll(qk, half, -1) * sin
    q, k = qk[:, :-kvh], qk[:, -kvh:]
    v = y[:, nqk:].view(b, kvh, hd)
    kc, vc = cache.update(k[:, :, None], v[:, :, None], i)
    # one query per row: the heads sharing a KV head become that head's queries
    q = q.reshape(b, kvh, -1, hd).to(kc.dtype)
    att = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=attn.scaling)
    x = x + o_proj(att.reshape(b, -1).float())
    gu = gate_up(x, norm=layer.post_attention_layernorm)
    inter = gu.shape[1] // 2
    return x + down(layer.mlp.act_fn(gu[:, :inter]) * gu[:, inter:])


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    """transformers' RMSNorm on fp32 x (the same result: x * rsqrt(mean(x^2) + eps) * weight)."""
    w = norm.weight
    return F.rms_norm(x, w.shape, w if w.dtype == x.dtype else w.float(), norm.variance_epsilon)
