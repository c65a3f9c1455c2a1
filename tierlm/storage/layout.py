"""Where each parameter's state lives in the store: shards, slots and key names.

Every state tensor is cut into shards of at most `shard_elems` elements so that the optimizer's
working set is bounded whatever the tensor (a 150k x 900 embedding is 136M elements). Optimizer
state is double-slotted: a step reads slot s and writes slot 1-s, so the state it started from stays
intact until the step commits (exact clipping redoes from it; a crash falls back to it).
"""
from __future__ import annotations

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

    def shard_numel(self, k: int) -> int:
        a, b = self.shards[k]
        return b - a


def make_param_info(name: str, shape, shard_elems: int = DEFAULT_SHARD_ELEMS) -> ParamInfo:
    assert shard_elems % 2048 == 0, "shard size must keep bf16 shards 4 KiB-aligned"
    numel = 1
    for s in shape:
        numel *= s
    shards = tuple((a, min(a + shard_elems, numel)) for a in range(0, max(numel, 1), shard_elems))
    return ParamInfo(name, tuple(shape), numel, shards)


def key(kind: str, name: str, shard: int, slot: int | None = None) -> str:
    """kind: 'w' (working weights), 'master', 'm', 'v' (slotted); 'grad', 'gacc' (not slotted)."""
    return f"{kind}{slot}/{name}.{shard}" if slot is not None else f"{kind}/{name}.{shard}"


def nbytes(dtype: torch.dtype, numel: int) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()
