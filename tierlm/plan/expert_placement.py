"""Where a mixture of experts' weights live under `--cpu-mem` when the model does not fit: every
layer's dense part (attention, norms, router, shared experts: what every token reads) resident as
far as it fits, the rest of the budget an expert cache of whole experts. Pure arithmetic.

Dense parts first: each decode step reads all of them, and only the routed experts of each layer,
so a byte of RAM given to a dense part saves a read every step where a byte of cache saves one only
when its expert is picked. The cache holds at least one layer's experts, as a prompt chunk may route
to all of them in one step.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..storage import BudgetError
from ..units import fmt_bytes
from .inference import InferConfig, Placement


@dataclass
class ExpertPlacement:
    placement: Placement   # the dense parts: layer_bytes is a layer's dense part
    cache: int             # expert cache bytes
    slot_bytes: int        # one expert's weights (every stacked parameter's slice)
    experts: int           # experts per layer
    moe_layers: int        # layers with experts

    @property
    def slots(self) -> int:
        return self.cache // self.slot_bytes

    @property
    def cached_share(self) -> float:
        """Share of all experts the cache holds at once."""
        return min(1.0, self.slots / max(self.experts * self.moe_layers, 1))

    def describe(self) -> str:
        p = self.placement
        return (f"dense parts of {p.resident}/{p.layers} layers resident, {p.streamed} streamed; experts of "
                f"{self.moe_layers} layers streamed through an expert cache of {self.slots} experts "
                f"({fmt_bytes(self.cache)}, {self.cached_share:.0%} of all); budget {fmt_bytes(p.budget)} = baseline "
                f"{fmt_bytes(p.baseline)} + embeddings/head {fmt_bytes(p.fixed)} + dense parts "
                f"{fmt_bytes(p.resident * p.layer_bytes)} + stream window {fmt_bytes(p.window)} + expert cache "
                f"{fmt_bytes(self.cache)} + {p.kv_name} {fmt_bytes(p.kv)} + compute {fmt_bytes(p.scratch)}")


def plan_expert_placement(cfg: InferConfig, baseline: int, fixed: int, dense_bytes: int, layers: int,
                          kv: int, scratch: int, experts: tuple[int, int, int],
                          kv_name: str = "KV cache") -> ExpertPlacement:
    """experts: (bytes of one expert, experts per layer, layers with experts)."""
    slot, per_layer, moe_layers = experts
    avail = cfg.cpu_mem - baseline - fixed - kv - scratch
    least = per_layer * slot
    want = cfg.resident_layers if cfg.resident_layers is not None else layers
    want = max(0, min(want, layers))
    window = 0 if want == layers and layers * dense_bytes + least <= avail else (cfg.prefetch + 1) * dense_bytes
    if avail < window + least:
        need = cfg.cpu_mem - avail + window + least
        raise BudgetError(
            f"--cpu-mem {fmt_bytes(cfg.cpu_mem)} cannot run this model: at least {fmt_bytes(need)} is needed "
            f"(process baseline {fmt_bytes(baseline)}, embeddings and head {fmt_bytes(fixed)}, {kv_name} "
            f"{fmt_bytes(kv)} for --max-batch {cfg.max_batch} x --max-seq-len, compute {fmt_bytes(scratch)}, "
            f"a stream window of {fmt_bytes(window)}, an expert cache of one layer's {per_layer} experts "
            f"{fmt_bytes(least)}). Raise --cpu-mem to {fmt_bytes(need * 1.05)}, or lower --max-batch / "
            f"--max-seq-len / --step-tokens / --prefetch")
    resident = want if window == 0 else min(want, max(0, (avail - window - least) // max(dense_bytes, 1)))
    cache = min(avail - window - resident * dense_bytes, per_layer * moe_layers * slot)  # never past all experts
    cache -= cache % slot
    dense = Placement(cfg.cpu_mem, baseline, fixed, kv, scratch, dense_bytes, layers, int(resident), window, kv_name)
    return ExpertPlacement(dense, int(cache), slot, per_layer, moe_layers)
