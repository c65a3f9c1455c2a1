"""A mixture of experts' experts at inference: each routed expert's rows through the decode kernels.

transformers' experts modules dispatch their forward by name (`config._experts_implementation`:
its eager loop, `grouped_mm`, `batched_mm`, ...) and describe their weights by flags the decorator
sets (`has_gate`, `has_bias`, `is_transposed`, `has_post_expert_norm`) and their gate by
`_apply_gate`. This is one more implementation on that interface, registered as "tierlm_rows": the
eager loop's order (each routed expert in turn, its tokens together, added into the output), with
each product on `gemv.linear`, where one row of bf16 runs on tierlm's matrix-vector kernel. On a
CPU transformers' grouped product ran every expert, routed or not (5140 products for 10 decode
tokens of a 2-layer 128-expert model), and the eager loop's F.linear read a routed expert's bf16
weights at 11 GB/s where the kernel reads the head's at 52 (a Qwen3-30B-A3B-shaped layer, 2-vCPU
Zen 4). Only the routed experts are indexed, so a streamed layer's experts module may hold just
those (tierlm.infer.experts).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .gemv import linear

NAME = "tierlm_rows"


def _product(x: torch.Tensor, w, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if callable(w):  # a quantised expert's matrix (experts.QSlice), turned to [out, in] when stored
        y = w(x)
        return y if b is None else y + b
    if transposed:  # [in, out]: GPT-OSS stores its experts this way round
        y = x @ w
        return y if b is None else y + b
    return linear(x, w, b)


def rows_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(hidden_states)
    for e in torch.unique(top_k_index).tolist():
        if not 0 <= e < self.num_experts:  # expert parallelism's sentinel: not this process's expert
            continue
        token_idx, pos = torch.where(top_k_index == e)
        x = hidden_states[token_idx]
        up = self.gate_up_proj if self.has_gate else self.up_proj
        up_b = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[e] if self.has_bias else None
        h = _product(x, up[e], up_b, self.is_transposed)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        y = _product(h, self.down_proj[e], self.down_proj_bias[e] if self.has_bias else None, self.is_transposed)
        if self.has_post_expert_norm:
            y = self.post_expert_norm(y)
        out.index_add_(0, token_idx, (y * top_k_weights[token_idx, pos, None]).to(out.dtype))
    return out


def use_expert_rows(model: nn.Module) -> int:
    """Run every experts module of `model` on "tierlm_rows"; returns how many. Each module gets a
    copy of the config naming it, so nothing else the config reaches changes (a training engine of
    the same model keeps the family's default)."""
    from transformers.integrations.moe import ExpertsInterface

    if NAME not in ExpertsInterface():
        ExpertsInterface.register(NAME, rows_experts_forward)
    n = 0
    for mod in model.modules():
        if hasattr(mod, "_is_expert_parallel") and hasattr(mod, "config"):
            mod.config = copy.copy(mod.config)
            mod.config._experts_implementation = NAME
            n += 1
    return n
