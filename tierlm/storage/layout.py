"""Where each parameter's state lives in the store: shards, slots and key names.

Every state tensor is cut into shards of at most `shard_elems` elements so that the optimizer's
working set is bounded whatever the tensor (a 150k x 900 embedding is 136M elements). Optimizer
state is double-slotted: a step reads slot s and writes slot 1-s, so the state it started from stays
intact until the step commits (exact clipping redoes from it; a crash falls back to it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# 4M elements: 16 MiB per fp32 shard, a multiple of 2048 so every full shard is 4 KiB-aligned in bf16.
DEFAULT_SHARD_ELEMS = 1 << 22


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple
    numel: int
    shards: tuple  # ((start, end), ...) in flat elements
    experts: int = 0  # a stacked experts' parameter ([experts, ...]) cut on expert boundaries

    def shard_numel(self, k: int) -> int:
        a, b = self.shards[k]
        return b - a

    def shard_experts(self, k: int) -> range:
        """The experts whose rows shard k holds (only for a parameter cut by expert)."""
        per = self.numel // self.experts
        a, b = self.shards[k]
        return range(a // per, (b - 1) // per + 1)


def make_param_info(name: str, shape, shard_elems: int = DEFAULT_SHARD_ELEMS, experts: int = 0) -> ParamInfo:
    """experts: the parameter stacks that many experts along its first dimension: its shards hold
    whole experts, or one expert's part, never two experts' parts (see expert_shards)."""
    assert shard_elems % 2048 == 0, "shard size must keep bf16 shards 4 KiB-aligned"
    numel = 1
    for s in shape:
        numel *= s
    if experts and numel and shape[0] == experts:
        by_expert = expert_shards(numel // experts, experts, shard_elems)
        if by_expert is not None:
            return ParamInfo(name, tuple(shape), numel, by_expert, experts)
    shards = tuple((a, min(a + shard_elems, numel)) for a in range(0, max(numel, 1), shard_elems))
    return ParamInfo(name, tuple(shape), numel, shards)


def expert_shards(per: int, experts: int, shard_elems: int) -> tuple | None:
    """Shards of `experts` stacked experts of `per` elements each, every boundary on an expert's
    and every start on a 2048-element block (bf16 shards 4 KiB-aligned, compressed moments'
    blocks whole): as many whole experts as fit a shard in groups whose size is a multiple of
    2048, or, for an expert larger than that, each expert in shards of its own. None where
    neither keeps the blocks whole (an expert over a shard that is no multiple of 2048)."""
    numel = per * experts
    group = math.lcm(per, 2048)  # the fewest whole experts that end on a block boundary
    if group <= shard_elems:
        size = shard_elems // group * group
        return tuple((a, min(a + size, numel)) for a in range(0, numel, size))
    if per % 2048 == 0:
        return tuple((e * per + a, e * per + min(a + shard_elems, per))
                     for e in range(experts) for a in range(0, per, shard_elems))
    return None


def key(kind: str, name: str, shard: int, slot: int | None = None) -> str:
    """kind: 'w' (working weights), 'master', 'm', 'v' (slotted); 'grad', 'gacc' (not slotted)."""
    return f"{kind}{slot}/{name}.{shard}" if slot is not None else f"{kind}/{name}.{shard}"


def nbytes(dtype: torch.dtype, numel: int) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()
