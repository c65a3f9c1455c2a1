"""A model's shape for planning: parameter counts per block, widths, heads, vocabulary.

The counts come from the Hugging Face model itself, built on the `meta` device (no parameter takes
memory), so any architecture transformers knows is sized exactly, even a 405B one, in a few hundred
MB of process memory (most of it the torch and transformers imports).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch
from transformers import AutoModelForCausalLM

from ..hf.fields import get, intermediate, head_dim as head_dim_of
from ..hf.kv_layout import kv_token_bytes
from ..hf.structure import find_layers
from .moe import EXPERT_FIELDS, TOP_K_FIELDS, MoeShape, experts_in_config, experts_per_token, moe_shape

# Shapes of models the planner is asked about that tierlm has no `init` preset for (planning only).
PLAN_SHAPES = {
    # Brown et al. 2020, Table 2.1: 40 layers, 40 heads of 128 (the table's d_model 5140 does not
    # divide by 40 heads; 40 x 128 = 5120 is what the heads give), context 2048.
    "gpt3-13b": ("gpt2", "GPT-3 13B (Brown et al. 2020, Table 2.1)",
                 dict(layers=40, hidden=5120, heads=40, kv_heads=40, intermediate=4 * 5120, vocab=50257,
                      max_positions=2048, tie_embeddings=True)),
    "llama-3.1-8b": ("llama", "meta-llama/Llama-3.1-8B config.json",
                     dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                          max_positions=131072, tie_embeddings=False)),
    "llama-3.1-70b": ("llama", "meta-llama/Llama-3.1-70B config.json",
                      dict(layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=128256,
                           max_positions=131072, tie_embeddings=False)),
    "llama-3.1-405b": ("llama", "meta-llama/Llama-3.1-405B config.json",
                       dict(layers=126, hidden=16384, heads=128, kv_heads=8, intermediate=53248, vocab=128256,
                            max_positions=131072, tie_embeddings=False)),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    source: str
    params: int              # unique parameters (tied embeddings once)
    embed_params: int        # input embeddings (token + learned positions): lookups, no FLOPs
    head_params: int         # final norm + output projection when it is its own matrix
    layer_params: int        # one decoder layer (a mixture of experts' layers may differ: their mean)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated_mlp: bool          # SwiGLU-style (three matrices) rather than two
    moe: MoeShape | None = None  # a mixture of experts' routed experts (moe.py); None for a dense model
    kv_width: int | None = None  # elements a layer caches a token (keys and values); None: 2 x kv_dim
    largest_layer_params: int = 0  # the largest decoder layer where they differ (Gemma 4's global ones)

    @property
    def block_params(self) -> int:
        """One decoder layer's parameters as a block of the window or a resident layer: the largest."""
        return max(self.layer_params, self.largest_layer_params)

    @property
    def active_params(self) -> int:
        """Parameters a token goes through: all of them, but for a mixture of experts only its routed
        experts' top_k a layer."""
        return self.moe.active_params if self.moe else self.params

    @property
    def active_layer_params(self) -> float:
        """One decoder layer's parameters a token goes through (a mixture of experts: their mean)."""
        if self.moe is None:
            return self.layer_params
        return (self.active_params - self.embed_params - self.head_params) / self.layers

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def kv_elems(self) -> int:
        """Elements of keys and values a layer caches a token (latent attention caches its
        compressed KV and rotary key instead: hf.kv_layout)."""
        return self.kv_width if self.kv_width is not None else 2 * self.kv_dim

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies by: every layer (a mixture of experts: the experts it is
        routed to), plus the output projection (tied or not)."""
        if self.moe is not None:
            return self.active_params - self.embed_params - self.head_params + self.vocab * self.hidden
        return self.layers * self.layer_params + self.vocab * self.hidden

    def to_json(self) -> dict:
        out = asdict(self)
        if self.moe is not None:  # with its derived counts (active, dense, routed)
            out["moe"] = self.moe.to_json()
        return out


def shape_of(config, model_name: str, source: str) -> ModelShape:
    """The shape of the model `config` describes, counted on `meta`; model_name and source say which it is."""
    with torch.device("meta"):  # parameters and buffers take no memory
        m = AutoModelForCausalLM.from_config(config)
    layers_name, layer_list = find_layers(m)
    n = len(layer_list)  # decoder layers (LongCat-Flash's config counts its attention sublayers)
    per_layer, routed, stacked = [0] * n, [0] * n, set()
    embed = head = 0
    seen: set[int] = set()
    embeddings = {id(mod.weight) for mod in m.modules() if isinstance(mod, torch.nn.Embedding)}
    for name, p in m.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        hit = re.match(re.escape(layers_name) + r"\.(\d+)\.", name)
        if hit:
            per_layer[int(hit.group(1))] += p.numel()
            if ".experts." in name[hit.end() - 1:]:  # a routed expert's weights (not shared_experts)
                routed[int(hit.group(1))] += p.numel()
                stacked.add(p.shape[0])
        elif id(p) in embeddings:
            embed += p.numel()
        else:
            head += p.numel()
    # a gated MLP (SwiGLU, GeGLU) multiplies three matrices, whatever the family calls them
    gated = any("gate" in name for name, _ in m.get_submodule(layers_name)[0].named_modules())
    del m
    moe = _moe(config, model_name, per_layer, embed + head, routed, stacked)
    hidden, heads = get(config, "hidden"), get(config, "heads")
    inter = intermediate(config, 4 * hidden)
    return ModelShape(
        name=model_name, model_type=config.model_type,
        source=source, params=sum(per_layer) + embed + head, embed_params=embed, head_params=head,
        # layers that differ (a mixture's dense first layers, Gemma 4's wider global ones): their mean
        layer_params=per_layer[0] if len(set(per_layer)) == 1 else round(sum(per_layer) / n), layers=n, hidden=hidden,
        intermediate=inter, heads=heads,
        kv_heads=get(config, "kv_heads") or heads, head_dim=head_dim_of(config),
        vocab=config.vocab_size, gated_mlp=gated, moe=moe, kv_width=_kv_width(config, n),
        largest_layer_params=max(per_layer))


def _kv_width(config, n: int) -> int | None:
    """What a decoder layer's KV cache holds a token where it is not 2 x kv heads x head_dim (latent
    attention, layers of different widths or with more or fewer heads than the config's, two
    attention sublayers a layer, as the model writes them: hf.kv_layout), else None; the mean of
    the `n` layers, rounded up."""
    width = -(-kv_token_bytes(config) // n)
    heads = get(config, "heads")
    return None if width == 2 * (get(config, "kv_heads") or heads) * head_dim_of(config) else width


def _moe(config, model_name: str, per_layer: list[int], outside: int, routed: list[int],
         stacked: set[int]) -> MoeShape | None:
    """The routed experts counted on the model: each layer's parameters under `.experts.`; how many
    experts a layer has from the config, else from the stacked parameters' first dimension."""
    if not any(routed):
        return None
    experts = experts_in_config(config) or (stacked.pop() if len(stacked) == 1 else None)
    top_k = experts_per_token(config)
    if experts is None or top_k is None:
        raise ValueError(f"{model_name}: a mixture of experts whose config names no expert count or experts a "
                         f"token (fields {', '.join(EXPERT_FIELDS + TOP_K_FIELDS)}); not planned yet")
    return moe_shape(sum(per_layer) + outside, routed, experts, top_k, per_layer)
