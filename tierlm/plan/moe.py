"""A mixture of experts' shape and its arithmetic: total against active parameters, the bytes a
decode step reads, an expert cache's hit rate under uniform routing, and the decode-time bound the
planner prints and the inference engine's report computes again with its measured hit rate.

transformers builds each layer's routed experts as stacked parameters under `mlp.experts`
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], biases where the family has them), beside the
router and any shared experts, which every token goes through. shapes.shape_of counts them on the
`meta` device; the config is read only for how many experts a token is routed to, whose field name
differs between families. Pure arithmetic: nothing here reads a file.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

# The config fields naming the routed experts a token goes through, and the experts of a layer, in
# the families transformers builds (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss: the first;
# Hunyuan: moe_topk; ...).
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "top_k", "top_k_experts")
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def _first_int(config, names: tuple[str, ...]) -> int | None:
    for name in names:
        v = getattr(config, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def experts_per_token(config) -> int | None:
    """Routed experts a token goes through in each layer of experts, as the config names it."""
    return _first_int(config, TOP_K_FIELDS)


def experts_in_config(config) -> int | None:
    """Routed experts of a layer, as the config names them (None where it names none)."""
    return _first_int(config, EXPERT_FIELDS)


@dataclass(frozen=True)
class MoeShape:
    """The routed experts of a model, in parameters. Everything else (embeddings, attention, norms,
    routers, shared experts, dense layers, the head) is the dense part, read by every token."""
    experts: int        # routed experts in each layer of experts
    top_k: int          # routed experts a token goes through in each of those layers
    expert_params: int  # one routed expert: its slice of every stacked parameter
    moe_layers: int     # decoder layers with routed experts
    total_params: int   # the model's unique parameters (tied embeddings once)
    dense_layer_params: int = 0  # the largest decoder layer's dense part (a resident layer's room)

    @property
    def routed_params(self) -> int:
        """Every routed expert of every layer."""
        return self.experts * self.expert_params * self.moe_layers

    @property
    def dense_params(self) -> int:
        return self.total_params - self.routed_params

    @property
    def active_params(self) -> int:
        """Parameters a token goes through: the dense part plus top_k routed experts a layer
        (embeddings counted as the dense plan counts them, whole)."""
        return self.dense_params + self.moe_layers * self.top_k * self.expert_params

    @property
    def all_experts(self) -> int:
        return self.experts * self.moe_layers

    def routed_read_params(self, tokens: int = 1) -> float:
        """Routed-expert parameters a step of `tokens` tokens reads (each picked expert once): with
        routing uniform and independent between tokens, a layer's step touches
        E·(1 − (1 − k/E)^tokens) distinct experts; one token, exactly top_k."""
        if tokens <= 1:
            return float(self.moe_layers * self.top_k * self.expert_params)
        touched = self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** tokens)
        return self.moe_layers * touched * self.expert_params

    def to_json(self) -> dict:
        return {**asdict(self), "routed_params": self.routed_params, "dense_params": self.dense_params,
                "active_params": self.active_params}


def moe_shape(total_params: int, experts_params_per_layer: list[int], experts: int, top_k: int,
              layer_params: list[int] | None = None) -> MoeShape:
    """The MoeShape from counts: each decoder layer's routed-expert parameters (0 for a dense
    layer), the experts of a layer, the experts a token is routed to, and each layer's parameters
    (for the largest dense part; none given, 0)."""
    routed = [n for n in experts_params_per_layer if n]
    if not routed:
        raise ValueError("moe_shape: no layer has routed experts")
    if len(set(routed)) != 1 or routed[0] % experts:
        raise ValueError(f"moe_shape: layers of experts of different sizes ({sorted(set(routed))}) or not "
                         f"{experts} equal experts; not planned yet")
    if not 0 < top_k <= experts:
        raise ValueError(f"moe_shape: {top_k} experts a token out of {experts}")
    dense_layer = max((n - e for n, e in zip(layer_params, experts_params_per_layer)), default=0) \
        if layer_params else 0
    return MoeShape(experts, top_k, routed[0] // experts, len(routed), total_params, dense_layer)


def uniform_hit_rate(cached_experts: float, all_experts: int) -> float:
    """The expert cache's hit rate if routing were uniform: the share of all experts it holds,
    min(1, cached / all). An assumption: real routing is skewed, and a cache that keeps the experts
    picked most often hits more."""
    if all_experts <= 0:
        return 1.0
    return min(1.0, max(0.0, cached_experts / all_experts))


class MoeDecodeBound(NamedTuple):
    """A decode step's time bound split by where its bytes come from (seconds)."""
    ram_s: float      # the dense part and the routed experts found in RAM
    ssd_s: float      # routed experts missed (and dense parts streamed), read from the SSD
    compute_s: float

    @property
    def total_s(self) -> float:
        return self.ram_s + self.ssd_s + self.compute_s

    def shares(self) -> dict[str, float]:
        """Each part's share of the bound."""
        t = self.total_s or 1.0
        return {"ram": self.ram_s / t, "ssd": self.ssd_s / t, "compute": self.compute_s / t}


def moe_decode_bound(dense_bytes: float, routed_bytes: float, hit_rate: float, ram_bps: float,
                     ssd_bps: float, compute_s: float = 0.0, dense_ssd_bytes: float = 0.0) -> MoeDecodeBound:
    """The time bound of one decode step of a mixture of experts whose routed experts come from an
    expert cache in RAM, misses read from the SSD:

        (dense_bytes + h · routed_bytes) / ram_bps + ((1 − h) · routed_bytes + dense_ssd_bytes) / ssd_bps
        + compute_s

    dense_bytes: bytes every step reads from RAM whatever the routing (attention, norms, routers,
    shared experts, dense layers, head). routed_bytes: the routed experts' bytes the step reads (one
    token: top_k experts a layer of experts). hit_rate h: the share of those found in the cache; the
    planner assumes uniform routing (`uniform_hit_rate`), the inference engine passes the rate it
    measured. ram_bps, ssd_bps: read rates in bytes/s. compute_s: the step's compute. dense_ssd_bytes:
    dense parts that did not fit in RAM and stream from the SSD (0 where they all fit).

    The parts are added, not overlapped: an upper bound for a pipeline that reads while it computes.
    """
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"moe_decode_bound: hit rate {hit_rate} is not in [0, 1]")
    if ram_bps <= 0:
        raise ValueError("moe_decode_bound: the RAM read rate must be positive")
    from_ssd = (1.0 - hit_rate) * routed_bytes + dense_ssd_bytes
    if from_ssd > 0 and ssd_bps <= 0:
        raise ValueError(f"moe_decode_bound: {from_ssd:.0f} bytes a step come from the SSD, but its read rate is "
                         f"{ssd_bps}")
    return MoeDecodeBound((dense_bytes + hit_rate * routed_bytes) / ram_bps,
                          from_ssd / ssd_bps if from_ssd > 0 else 0.0, compute_s)


class MoeBytes(NamedTuple):
    """A mixture of experts' weights in bytes, in the format they are served in."""
    dense: float         # the dense part, read by every step
    routed: float        # every routed expert of every layer
    routed_read: float   # the routed experts' bytes a step reads
    expert: float        # one routed expert
    active_token: float  # what one token reads: the dense part and top_k experts a layer of experts


def moe_bytes(m: MoeShape, total_bytes: float, expert_bytes_per_param: float, tokens: int = 1) -> MoeBytes:
    """The bytes of `m` whose weights take `total_bytes` in all, its experts `expert_bytes_per_param`
    a parameter, for a step of `tokens` tokens (routing uniform: MoeShape.routed_read_params)."""
    routed = m.routed_params * expert_bytes_per_param
    expert = m.expert_params * expert_bytes_per_param
    dense = total_bytes - routed
    return MoeBytes(dense, routed, m.routed_read_params(tokens) * expert_bytes_per_param, expert,
                    dense + m.moe_layers * m.top_k * expert)


class TierReads(NamedTuple):
    """Where a decode step's bytes come from, per tier (fastest first)."""
    reads: dict[str, float]   # bytes a step reads from the tier
    dense: dict[str, float]   # of which the dense part
    experts: dict[str, int]   # routed experts the tier holds
    shares: dict[str, float]  # the share of a step's routed reads served by the tier (uniform routing)


def tier_reads(held: dict[str, float], b: MoeBytes, all_experts: int) -> TierReads:
    """The dense part takes the fastest tiers first (every step reads it; an expert is read only
    when picked), then whole experts what room the tiers have left, the last tier the rest. With
    routing uniform each tier serves its share of the experts' reads: experts it holds / all."""
    tiers = list(held)
    dense_left, experts_left = b.dense, all_experts
    reads, dense, experts, shares = {}, {}, {}, {}
    for i, t in enumerate(tiers):
        dense[t] = min(dense_left, held[t])
        dense_left -= dense[t]
        room = held[t] - dense[t]
        # whole experts (a hair of slack: float bytes that should divide exactly)
        fits = int((room + 1e-6 * b.expert) // b.expert) if b.expert else 0
        n = experts_left if i == len(tiers) - 1 else min(experts_left, fits)
        experts[t], experts_left = n, experts_left - n
        shares[t] = uniform_hit_rate(n, all_experts) if all_experts else 0.0
        reads[t] = dense[t] + shares[t] * b.routed_read
    return TierReads(reads, dense, experts, shares)
