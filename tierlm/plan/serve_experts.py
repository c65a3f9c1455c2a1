"""`tierlm plan --hardware this --cpu-mem` for a mixture of experts: the inference engine's own
placement, as the tiers a decode step reads from. Whole layers where they all fit
(plan.inference.plan_placement); else every layer's dense part resident as far as it fits and an
expert cache of whole experts in what the budget leaves (plan.expert_placement), the rest streamed.
Pure arithmetic."""
from __future__ import annotations

from ..storage import BudgetError
from . import cost as C
from .expert_placement import plan_expert_placement
from .inference import InferConfig, plan_placement, scratch_bytes
from .moe import MoeBytes, TierReads, tier_reads, uniform_hit_rate
from .records import Task
from .shapes import ModelShape


def engine_tiers(s: ModelShape, task: Task, b: MoeBytes, layer_w: float, fixed_w: float,
                 baseline: int) -> tuple[TierReads, int]:
    """The tiers the engine's placement reads a decode step from under task.cpu_mem, and the
    decoder layers whose dense parts (whole layers, where all fit) stay resident. layer_w: a
    decoder layer's bytes in the serving format (the mean); fixed_w: the rest (embeddings, head);
    baseline: the engine's process baseline beyond its libraries. Raises BudgetError where the
    engine would refuse the budget."""
    m, max_len = s.moe, task.seq_len + task.new_tokens
    cfg = InferConfig(cpu_mem=task.cpu_mem, max_batch=task.batch, max_seq_len=max_len, weights=task.weights)
    kv = task.batch * (max_len + 1) * C.kv_bytes_per_token(s)
    fixed = (s.embed_params + s.head_params) * C.W_BYTES
    scratch = scratch_bytes(C.hf_like_config(s), cfg, max_len)
    W = s.layers * layer_w + fixed_w
    try:
        if plan_placement(cfg, baseline, fixed, int(layer_w), s.layers, kv, scratch).resident == s.layers:
            return tier_reads({"gpu": 0, "ram": W, "nvme": 0}, b, m.all_experts), s.layers
    except BudgetError:
        pass  # experts need no window of whole layers: they stream through the cache
    dense_layer = C.weight_bytes_per_param(task.weights, s.hidden) * m.dense_layer_params
    ep = plan_expert_placement(cfg, baseline, fixed, int(dense_layer), s.layers, kv, scratch,
                               (int(b.expert), m.experts, m.moe_layers))
    # the streamed layers' dense parts are read from the SSD each step (their mean size)
    dense_ssd = ep.placement.streamed * (b.dense - fixed_w) / s.layers
    dense = {"gpu": 0.0, "ram": b.dense - dense_ssd, "nvme": dense_ssd}
    experts = {"gpu": 0, "ram": ep.slots, "nvme": m.all_experts - ep.slots}
    hit = uniform_hit_rate(ep.slots, m.all_experts)
    shares = {"gpu": 0.0, "ram": hit, "nvme": 1.0 - hit}
    reads = {t: dense[t] + shares[t] * b.routed_read for t in dense}
    return TierReads(reads, dense, experts, shares), ep.placement.resident
