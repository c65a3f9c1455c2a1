"""The engine's budget split, from the model it wraps: each block's weights and gradients, the
optimizer's shard buffers, a tied head's held gradient, and the activations and logits of a
micro-batch (the arithmetic is `budget.plan_split` / `plan_gpu`). `eng` is the Engine."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..storage import BudgetError
from ..storage.aligned import round_up
from ..units import fmt_bytes
from ..plan import budget as B
from . import state_quant as SQ
from ..storage.layout import nbytes
from .optim_types import shard_buffer_bytes


def packed_bytes(eng) -> int:
    """RAM the store's small tensors take (storage/packed.py): of each shard under the threshold,
    both slots of master, m, v and the working weights, a saved gradient and an accumulator."""
    below, mode = eng.cfg.pack_below, eng.cfg.optim_states
    total = 0
    for name, info in eng.infos.items():
        w = nbytes(eng.wdtype(name), 1) if eng.dtype != torch.float32 else 0
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
    weights = sum(round_up(nbytes(eng.wdtype(n), i.numel)) for n, i in eng.infos.items())
    return (state if eng.cfg.state_cache else None), weights


def plan_budget(eng, baseline: int) -> tuple[B.Split, int]:
    """The engine's `--cpu-mem` split from its blocks' sizes, and the allowance for kept
    activations (host RAM, or what `--gpu-mem` leaves with a GPU computing). A budget too small
    for the batch names the longest micro-batch that fits, if any does."""
    baseline += packed_bytes(eng)
    # weights used before the first layer are held through the step (residency: _hold_early),
    # beside whichever block computes
    early = {n: round_up(nbytes(eng.wdtype(n), eng.infos[n].numel)) for n in eng.early}
    max_w = max(sum(nbytes(eng.wdtype(n), eng.infos[n].numel) for n in {*b.uses, *early}) for b in eng.blocks)
    # each parameter has its own page-aligned buffer in the window's pool
    win = B.window_size([{**early, **{n: round_up(nbytes(eng.wdtype(n), eng.infos[n].numel)) for n in b.uses}}
                         for b in eng.blocks], eng.prefetch)
    max_g = max(sum(nbytes(eng.wdtype(n), eng.infos[n].numel) for n in b.owns) for b in eng.blocks)
    layer_g = max(sum(nbytes(eng.wdtype(n), eng.infos[n].numel) for n in b.owns) for b in eng.blocks
                  if b.kind == "layer")
    shard = min(eng.shard_elems, max(i.numel for i in eng.infos.values()))
    item = shard_buffer_bytes(shard, None if eng.dtype == torch.float32 else eng.dtype, eng.cfg.optim_states)
    if eng.dtype != torch.float32 and eng.kept32:  # fp32 working weights: a wider shard in flight
        wide = min(eng.shard_elems, max(eng.infos[n].numel for n in eng.kept32))
        item = max(item, shard_buffer_bytes(wide, torch.float32, eng.cfg.optim_states))
    n_layers = sum(b.kind == "layer" for b in eng.blocks)
    # a weight the head uses but another block owns (tied): its head gradient is held
    # (engine/tied.py) until the owner's arrives at the end of backward
    held = sum(nbytes(eng.wdtype(n), eng.infos[n].numel) for b in eng.blocks if b.kind == "head"
               for n in b.uses if n not in b.owns)
    state_total, weights_total = whole_model_bytes(eng)

    bsz = max(eng.cfg.micro_batch_size, 1)

    def sizes(tokens: int) -> tuple[int, int, int]:
        act = B.layer_activation_bytes(eng.config, tokens, eng.dtype, seq=max(tokens // bsz, 1))
        inp = tokens * eng.config.hidden_size * torch.empty((), dtype=eng.dtype).element_size()
        return act, inp, B.head_loss_bytes(eng.config, tokens, eng.dtype, eng._chunkable(),
                                           eng.cfg.loss_chunk, tied=held > 0)

    def split(tokens: int, budget: int | None = None) -> B.Split:
        budget = eng.cfg.cpu_mem if budget is None else budget
        if eng.on_gpu:  # activations, layer inputs, logits and the held gradient are on the GPU
            out = B.plan_split(budget, baseline, B.Needs(win, max_g, item, 0, 0, n_layers, 0, 0,
                                                         state_total=state_total, weights_total=weights_total),
                               reserve=B.GPU_HOST_RESERVE)
            return _swap_room(out, n_layers * sizes(tokens)[0], eng.cfg.activations)
        act, inp, logits = sizes(tokens)
        # the kernels' per-thread scratch: as many copies as this machine runs threads
        reserve = B.TRAINING_RESERVE + B.kernel_scratch_bytes(eng.config, max(tokens // bsz, 1), eng.dtype)
        return B.plan_split(budget, baseline, B.Needs(win, max_g, item, act, inp, n_layers, logits, held,
                                                      max_layer_grad=layer_g, state_total=state_total,
                                                      weights_total=weights_total), reserve=reserve)

    def gpu(tokens: int) -> int:
        act, inp, logits = sizes(tokens)
        return B.plan_gpu(gpu_budget(eng), max_w, max_g, act, inp, n_layers, logits, held)
    try:
        out = split(eng.cfg.tokens_per_micro_batch)
        allowance = gpu(eng.cfg.tokens_per_micro_batch) if eng.on_gpu else out.activations
    except BudgetError as e:
        def fits(tokens: int) -> None:
            split(tokens)
            if eng.on_gpu:
                gpu(tokens)
        raise BudgetError(str(e) + _longest_that_fits(fits, eng.cfg.tokens_per_micro_batch, bsz)) from None
    check_kept(eng, n_layers, sizes(eng.cfg.tokens_per_micro_batch)[0], allowance,
               lambda budget: split(eng.cfg.tokens_per_micro_batch, budget).activations)
    return out, allowance


def _swap_room(out: B.Split, every_layer: int, activations: str) -> B.Split:
    """With a GPU, the activations' share of host RAM is the pinned pool that swapped layers go to
    (kept ones stay in GPU memory). A run that may swap (auto, or a swap policy named) gets room for
    every layer's activations before the optimizer state cache, as a CPU run's activations come
    before it; keep and recompute runs leave the cache as it was."""
    if not any(p in ("auto", "swap", "swap-host") for p in activations.split(",")):
        return out
    take = min(out.state_cache, every_layer)
    return replace(out, activations=out.activations + take, state_cache=out.state_cache - take)


def _longest_that_fits(fits, tokens: int, bsz: int) -> str:
    """Under every activation policy the layer inputs, one layer's activations and the logits stay:
    the longest micro-batch (fewer than `tokens`) for which `fits` raises no BudgetError, named as
    the flags that give it, if any fits."""
    lo, hi = 0, tokens
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            fits(mid)
            lo = mid
        except BudgetError:
            hi = mid
    if lo >= bsz:
        return (f" Whatever the activation policy (keep, swap, recompute), the longest micro-batch that fits "
                f"is {lo} tokens: --seq-len {lo // bsz} at --batch-size {bsz}.")
    return " Not even a one-token micro-batch fits: the budget is below the weights' working set."


def check_kept(eng, n_layers: int, act: int, allowance: int, acts_at) -> None:
    """What the policies the user chose hold must fit the activations' allowance, or the run stops
    with the budget they need (auto keeps and swaps only what fits, layer by layer):
    - each layer told to keep (`--activations keep`, or `keep` in a per-layer list) holds its
      activations for the whole step;
    - swapping needs its staging pool to hold one layer's saved tensors: with less, the storages that
      find no room are written from the tensors themselves, and backward read back into buffers
      beside the pool's (20 layers at 4096 tokens, 41 MiB a layer, swapped through a 38 MiB pool peaked
      286 MiB beyond the libraries under --cpu-mem 256MiB; through 48 MiB, 167 MiB under 266MiB).
    Swapped and recomputed layers also hold their inputs, which the split counts apart.
    `acts_at(budget)`: the activations' share of a CPU split under `budget`."""
    pols = eng.cfg.activations.split(",")
    pols = pols * n_layers if len(pols) == 1 else pols
    if "auto" in pols:
        return
    kept = sum(p == "keep" for p in pols)
    # the staging pool is host RAM: on a GPU it takes none of the device's allowance
    swaps = any(p in ("swap", "swap-host") for p in pols) and not eng.on_gpu
    need = (kept + swaps) * act
    if need <= allowance:
        return
    what = (f"--activations {eng.cfg.activations}: " + (f"{kept} of {n_layers} layers keep" if kept else "")
            + (" and " if kept and swaps else "") + ("swapping stages one layer's" if swaps else "")
            + f" activations, {fmt_bytes(need)} ({fmt_bytes(act)} a layer, an upper estimate); "
            f"{fmt_bytes(allowance)} is left for them")
    if eng.on_gpu:
        raise BudgetError(f"{what} in --gpu-mem {fmt_bytes(gpu_budget(eng))}. Raise --gpu-mem by "
                          f"{fmt_bytes(need - allowance)} or more, or use --activations auto or recompute.")
    lo, hi = eng.cfg.cpu_mem, 2 * eng.cfg.cpu_mem + need
    while acts_at(hi) < need:
        lo, hi = hi, 2 * hi
    while hi - lo > (1 << 20):  # the least budget whose share holds them, to a MiB
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if acts_at(mid) >= need else (mid, hi)
    raise BudgetError(f"{what} under --cpu-mem {fmt_bytes(eng.cfg.cpu_mem)}. Raise --cpu-mem to {B.flag_bytes(hi)} "
                      f"or more, or use --activations auto or recompute (the same bits).")


def gpu_budget(eng) -> int:
    """--gpu-mem, or 90% of what is free now (read once: the longest-sequence search asks again)."""
    if eng.cfg.gpu_mem is None:
        free, _ = torch.cuda.mem_get_info(eng.device)
        eng.cfg.gpu_mem = int(free * 0.9)
    return eng.cfg.gpu_mem
