"""The engine's budget split, from the model it wraps: each block's weights and gradients, the
optimizer's shard buffers, a tied head's held gradient, and the activations and logits of a
micro-batch (the arithmetic is `budget.plan_split` / `plan_gpu`). `eng` is the Engine."""
from __future__ import annotations

import torch

from ..storage import BudgetError
from ..storage.aligned import round_up
from . import budget as B
from . import state_quant as SQ
from .layout import nbytes
from .optim_types import shard_buffer_bytes


def packed_bytes(eng) -> int:
    """RAM the store's small tensors take (storage/packed.py): of each shard under the threshold,
    both slots of master, m, v and the working weights, a saved gradient and an accumulator."""
    below, mode = eng.cfg.pack_below, eng.cfg.optim_states
    w = nbytes(eng.dtype, 1) if eng.dtype != torch.float32 else 0
    total = 0
    for info in eng.infos.values():
        for k in range(len(info.shards)):
            n = info.shard_numel(k)
            for b, copies in ((4 * n, 2), (SQ.stored_nbytes(mode, n), 4), (w * n, 2), (4 * n, 2)):
                total += b * copies if 0 < b < below else 0
    return total


def whole_model_bytes(eng) -> tuple[int | None, int]:
    """What the state cache would need to hold all the optimizer state (master, m and v of every
    shard, page-rounded as the cache holds them; None when the cache is off), and what the window
    would need to hold every working weight."""
    mode = eng.cfg.optim_states
    state = 0
    for info in eng.infos.values():
        for k in range(len(info.shards)):
            n = info.shard_numel(k)
            state += round_up(4 * n) + 2 * round_up(SQ.stored_nbytes(mode, n))
    weights = sum(round_up(nbytes(eng.dtype, i.numel)) for i in eng.infos.values())
    return (state if eng.cfg.state_cache else None), weights


def plan_budget(eng, baseline: int) -> tuple[B.Split, int]:
    """The engine's `--cpu-mem` split from its blocks' sizes, and the allowance for kept
    activations (host RAM, or what `--gpu-mem` leaves with a GPU computing). A budget too small
    for the batch names the longest micro-batch that fits, if any does."""
    baseline += packed_bytes(eng)
    max_w = max(sum(nbytes(eng.dtype, eng.infos[n].numel) for n in b.uses) for b in eng.blocks)
    # each parameter has its own page-aligned buffer in the window's pool
    win = B.window_size([{n: round_up(nbytes(eng.dtype, eng.infos[n].numel)) for n in b.uses}
                         for b in eng.blocks], eng.prefetch)
    max_g = max(sum(nbytes(eng.dtype, eng.infos[n].numel) for n in b.owns) for b in eng.blocks)
    layer_g = max(sum(nbytes(eng.dtype, eng.infos[n].numel) for n in b.owns) for b in eng.blocks
                  if b.kind == "layer")
    shard = min(eng.shard_elems, max(i.numel for i in eng.infos.values()))
    item = shard_buffer_bytes(shard, None if eng.dtype == torch.float32 else eng.dtype, eng.cfg.optim_states)
    n_layers = sum(b.kind == "layer" for b in eng.blocks)
    # a weight the head uses but another block owns (tied): its head gradient is held
    # (engine/tied.py) until the owner's arrives at the end of backward
    held = sum(nbytes(eng.dtype, eng.infos[n].numel) for b in eng.blocks if b.kind == "head"
               for n in b.uses if n not in b.owns)
    state_total, weights_total = whole_model_bytes(eng)

    def sizes(tokens: int) -> tuple[int, int, int]:
        act = B.layer_activation_bytes(eng.config, tokens, eng.dtype)
        inp = tokens * eng.config.hidden_size * torch.empty((), dtype=eng.dtype).element_size()
        return act, inp, B.head_loss_bytes(eng.config, tokens, eng.dtype, eng._chunkable(),
                                           eng.cfg.loss_chunk, tied=held > 0)

    def split(tokens: int) -> B.Split:
        if eng.on_gpu:  # activations, layer inputs, logits and the held gradient are on the GPU
            return B.plan_split(eng.cfg.cpu_mem, baseline, win, max_g, item, 0, 0, n_layers, 0,
                                0, reserve=B.GPU_HOST_RESERVE, state_total=state_total,
                                weights_total=weights_total)
        act, inp, logits = sizes(tokens)
        return B.plan_split(eng.cfg.cpu_mem, baseline, win, max_g, item, act, inp, n_layers,
                            logits, held, max_layer_grad=layer_g, state_total=state_total,
                            weights_total=weights_total)

    def gpu(tokens: int) -> int:
        act, inp, logits = sizes(tokens)
        return B.plan_gpu(gpu_budget(eng), max_w, max_g, act, inp, n_layers, logits, held)
    try:
        out = split(eng.cfg.tokens_per_micro_batch)
        return out, gpu(eng.cfg.tokens_per_micro_batch) if eng.on_gpu else out.activations
    except BudgetError as e:
        # Under every activation policy the layer inputs, one layer's activations and the
        # logits stay: name the longest sequence that fits, if any does.
        lo, hi = 0, eng.cfg.tokens_per_micro_batch
        while hi - lo > 1:
            mid = (lo + hi) // 2
            try:
                split(mid)
                if eng.on_gpu:
                    gpu(mid)
                lo = mid
            except BudgetError:
                hi = mid
        bsz = max(eng.cfg.micro_batch_size, 1)
        if lo >= bsz:
            hint = (f" Whatever the activation policy (keep, swap, recompute), the longest micro-batch that fits "
                    f"is {lo} tokens: --seq-len {lo // bsz} at --batch-size {bsz}.")
        else:
            hint = " Not even a one-token micro-batch fits: the budget is below the weights' working set."
        raise BudgetError(str(e) + hint) from None

def gpu_budget(eng) -> int:
    """--gpu-mem, or 90% of what is free now (read once: the longest-sequence search asks again)."""
    if eng.cfg.gpu_mem is None:
        free, _ = torch.cuda.mem_get_info(eng.device)
        eng.cfg.gpu_mem = int(free * 0.9)
    return eng.cfg.gpu_mem
