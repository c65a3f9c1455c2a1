"""Splitting the `cpu` budget between the parts of the working set, before anything runs.

The budget covers everything the process holds beyond the torch import: Python and transformers'
own objects (measured), the weight window, the optimizer's buffers, gradients waiting for the
optimizer, activations and the logits. If the smallest workable split does not fit, the run stops
with what is needed and the flag that changes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..hf.fields import intermediate, layer_kv_geometry, overrides, widest
from ..kernel_cache import KERNEL_CACHE_BYTES
from ..storage import BudgetError
from ..storage.layout import DEFAULT_SHARD_ELEMS
from ..units import fmt_bytes

# The head and loss a chunk of tokens at a time (engine/head_loss.py): when, and how many.
CHUNK_ABOVE = 256 << 20     # logits (all four copies) at or below this: HF's own path, exact
CHUNK_TARGET = 64 << 20     # a chunk's logits, all four copies, about this
# ...but never fewer tokens: each chunk reads the whole head weight three times and adds into its
# gradient, so small chunks are bound by memory. Qwen2.5-0.5B's head at 896 tokens, fp32, forward
# and backward on a 2-vCPU EPYC, two runs of benchmarks/head_loss_chunks.py: HF's whole logits
# 6.29 / 5.28 s; chunks of 27 tokens 13.00 / 11.76 s, 128 tokens 6.53 / 6.80 s, 256 tokens
# 7.14 / 6.50 s, 448 tokens 6.06 / 5.39 s (128 and 256 within the noise: the smaller one is kept).
MIN_CHUNK_TOKENS = 128


def logits_bytes_per_token(vocab: int, dtype: torch.dtype) -> int:
    """The compute-dtype logits, their fp32 upcast, the softmax and its gradient (budget.logits_bytes)."""
    return vocab * (dtype.itemsize + 12)


def chunk_tokens(tokens: int, vocab: int, dtype: torch.dtype, forced: int | None = None) -> int | None:
    """Tokens per chunk for a micro-batch of `tokens`, or None for HF's unchunked path.
    forced: 0 = never chunk, N > 0 = N tokens a chunk (tests), None = by the rule above."""
    if forced is not None:
        return None if forced == 0 or forced >= tokens else forced
    per = logits_bytes_per_token(vocab, dtype)
    if tokens * per <= CHUNK_ABOVE:
        return None
    chunk = max(MIN_CHUNK_TOKENS, CHUNK_TARGET // per)
    return None if chunk >= tokens else chunk


def shard_elems_for(budget: int, want: int | None = None) -> int:
    """Optimizer shard size: `want` elements (default 4M), or less where one shard's buffers (fp32
    master, m, v, gradient, working weights: 18 bytes an element) would pass a twentieth of the
    budget; a multiple of 2048."""
    n = budget // 20 // 18 // 2048 * 2048
    return max(2048, min((want or DEFAULT_SHARD_ELEMS) // 2048 * 2048, n))


@dataclass
class Split:
    budget: int
    baseline: int        # process RSS beyond the torch import when the engine starts
    window: int          # weight window pool
    optimizer: int       # optimizer pool
    grads: int           # gradients in flight between backward and the optimizer
    activations: int     # allowance for saved activations
    compute: int         # one block's transient compute plus logits
    state_cache: int = 0  # optimizer state kept resident between steps (what activations leave)
    # Of `grads`: what may wait for the optimizer; the rest holds the block autograd is making
    # meanwhile. With all of the share pending, Qwen2.5-0.5B (fp32, --cpu-mem 4GiB, 128 tokens)
    # peaked 4.24 GiB beyond the libraries, at the embedding's gradient after the last layer's
    # backward; with this, 3.98 GiB (one run each: the peak depends on how far the optimizer lags).
    pending_grads: int = 0
    # Of `compute`: a tied head's gradient, live through the whole backward (Needs.held_grad)
    held_grad: int = 0
    # Of `window`: what the state cache could not use (it holds all the state) and the window took,
    # so that it keeps the working weights between steps instead of reading them back
    weights_kept: int = 0

    @property
    def transient(self) -> int:
        """Of `compute`: what one block's compute allocates and frees again (its activations in
        the making, the logits, the kernels' scratch), the size of the heap's holes between two of
        HeapGuard's checks; not the held gradient, which is made once and lives through backward."""
        return self.compute - self.held_grad

    def describe(self) -> str:
        parts = ["baseline", "window", "optimizer", "grads", "activations", "compute", "state_cache"]
        return ", ".join(f"{p} {fmt_bytes(getattr(self, p))}" for p in parts)


def attention_dropout(config) -> float:
    """The attention's dropout probability (llama family: attention_dropout; GPT-2: attn_pdrop)."""
    for key in ("attention_dropout", "attn_pdrop"):
        p = getattr(config, key, None)
        if p:
            return float(p)
    return 0.0


def flash_attention(config) -> bool:
    """Whether a training step's attention runs PyTorch's fused CPU kernel (FlashAttentionKernel.cpp:
    it saves a logsumexp a query and head, never the scores). Which SDPA kernel runs depends on the
    inputs and settings, not on the CPU (sdp_utils_cpp.cpp): the fused one unless the model's
    attention is not SDPA (eager), dropout is on (a published GPT-2 has attn_pdrop 0.1), or flash is
    switched off (torch.backends.cuda.enable_flash_sdp(False) applies to the CPU too). The engine
    passes no attention mask. Otherwise the math path runs, which holds the seq x seq scores."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    return impl == "sdpa" and attention_dropout(config) == 0.0 and torch.backends.cuda.flash_sdp_enabled()


# Saved-for-backward bytes of each score (a query x key pair, per head) where the math path or the
# eager code runs: a 1024-token llama layer with attention dropout saved three fp32 copies (the scores,
# their softmax, the dropped-out probabilities: 96 MiB for 8 heads) in bf16 as in fp32, as autograd's
# saved-tensor hooks counted; the eager code saves the fp32 softmax, a one-byte dropout mask and the
# probabilities. 13 covers both.
SCORE_SAVED_BYTES = 13


def layer_activation_bytes(config, tokens: int, dtype: torch.dtype, seq: int | None = None) -> int:
    """Saved-for-backward bytes of one decoder layer for `tokens` in sequences of `seq` (default: one
    sequence, the most the attention's scores can be), an upper estimate; the run measures it.

    The attention adds its logsumexp (fp32, a query and head) where the fused kernel runs, and the
    seq x seq scores of each head where it does not (`flash_attention`): at 4096 tokens and 16 heads,
    3.3 GiB, not the 8 MiB of the fused kernel."""
    h = config.hidden_size
    inter = intermediate(config, 4 * h)
    # the largest of any layer's (dots3-note's differ); none in a state-space model (Mamba): no
    # attention, its states are in the 10 hidden states a token counted below
    heads = widest(config, "heads", 0)
    if not heads:
        kv_dim = 0
    elif overrides(config):  # the widest layer's keys (Gemma 4's global layers are wider than the rest)
        kv_dim = max(kh * kd for (kh, kd), _ in (layer_kv_geometry(config, i) for i in range(config.num_hidden_layers)))
    else:  # (a planning shape's config, a SimpleNamespace, has no per-layer values)
        kv_dim = h // heads * (getattr(config, "num_key_value_heads", None) or heads)
    per_token = 10 * h + 4 * inter + 4 * kv_dim + _routed_bytes_per_token(config, inter)
    out = tokens * per_token * dtype.itemsize
    if flash_attention(config):
        return out + 4 * heads * tokens
    return out + SCORE_SAVED_BYTES * heads * tokens * min(seq or tokens, tokens)


def _routed_bytes_per_token(config, inter: int) -> int:
    """What a mixture of experts adds (in elements a token): each of its top-k experts holds the
    token's hidden state, its own MLP width and its output (transformers' grouped product sorts a
    copy of the hidden states by expert), and their gradients in backward; a shared expert adds its
    width. The dense MLP width counted above is not the experts' (Qwen3-MoE's intermediate_size is
    a dense layer's; the routed width is top-k x moe_intermediate_size). A Qwen3-MoE-shaped model
    (hidden 1024, 64 experts, top 8, width 512) at 2 x 512 tokens in bf16 peaked 220 MiB past its
    --cpu-mem 1536MiB counted as a dense layer, 40 MiB past with 6 hidden states an expert: 8 here."""
    from ..hf.fields import ROLES

    def first(*names):
        return next((v for v in (getattr(config, n, None) for n in names) if v), None)
    k = first(*ROLES["experts_per_token"])
    experts = first("num_local_experts", "num_experts", "n_routed_experts")
    if not k or not experts:
        return 0
    width = first(*ROLES["expert_intermediate"]) or inter
    shared = first(*ROLES["shared_intermediate"]) or (first("n_shared_experts") or 0) * width
    return 4 * (k * width + shared) + 8 * k * config.hidden_size


# Per-thread scratch of the kernels one layer runs, which grows with the thread count (a 64-core
# machine runs 64 threads, each with its own buffers), so the reserve measured with two threads
# does not hold it:
# - the fused attention's per-thread blocks (FlashAttentionKernel.cpp, torch 2.3-2.13): a query block of
#   256 rows (64 from 192 tokens, 32 below) by a key block of 512; backward holds the scores and their
#   gradient in fp32 and, for bf16/fp16, a copy of each in the compute dtype (1.5 MiB a thread in bf16);
#   forward less (the scores, one row of output per query, and a compute-dtype copy);
# - the matrix products' packing buffers (oneDNN's brgemm on AVX512-BF16 and AMX, MKL in fp32): the
#   largest of a layer's bf16 products at 4096 tokens (hidden 1024, intermediate 2816) took 8.3 MiB at
#   2 threads, 24.8 at 16, 26.9 at 32 and 30.9 at 64 (0.4 MiB a thread); counted as 1 MiB a thread,
#   for other kernels' blockings (AMX's brgemm was not measured).
GEMM_SCRATCH_PER_THREAD = 1 << 20


def kernel_scratch_bytes(config, seq: int, dtype: torch.dtype, threads: int | None = None) -> int:
    """What `threads` (default: torch's intra-op threads) hold at once in one layer's kernels:
    the fused attention's blocks, where it runs, and the products' packing."""
    threads = threads or torch.get_num_threads()
    per = GEMM_SCRATCH_PER_THREAD
    if flash_attention(config):
        q_block = 256 if seq >= 768 else 64 if seq >= 192 else 32
        block = min(q_block, seq) * min(512, seq)
        es = dtype.itemsize
        per += block * (2 * 4 + (2 * es if dtype in (torch.bfloat16, torch.float16) else 0))
    return threads * per


def logits_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    """Logits in the compute dtype, their fp32 upcast, log-softmax and its gradient."""
    return tokens * config.vocab_size * (dtype.itemsize + 12)


def head_loss_bytes(config, tokens: int, dtype: torch.dtype, chunkable: bool = True,
                    forced: int | None = None, tied: bool = False) -> int:
    """What the head and the loss hold at once: the whole logits, or, where they run in chunks
    (`head_loss.chunk_tokens`), one chunk's logits and the head weight's gradient, which is made
    during forward (fp32 while it sums; a tied head's is the gradient the split already holds
    through backward, so it is not counted twice)."""
    chunk = chunk_tokens(tokens, config.vocab_size, dtype, forced) if chunkable else None
    if chunk is None:
        return logits_bytes(config, tokens, dtype)
    vh, es = config.vocab_size * config.hidden_size, dtype.itemsize
    head_grad = 4 * vh + (es * vh if dtype != torch.float32 else 0)  # bf16: the fp32 sum and its copy
    if tied:
        head_grad -= es * vh
    return logits_bytes(config, chunk, dtype) + head_grad


# Memory the process needs beyond what the split names: the compute kernels' caches and scratch
# for the model's real shapes (oneDNN primitives, ~15 MiB measured on a 512-wide llama's forward
# and backward), and the allocator's slack. Both hold oneDNN's kernel caches at their bound
# (KERNEL_CACHE_BYTES, 18 MiB): a mixture of experts builds new products every step (each expert's
# row count changes), and so does a server's prefill for every new prompt length (kernel_cache.py).
# Beside them, forward-only work (inference) keeps 4 MiB of scratch; training 10 MiB: its backward's
# scratch, and 4 MiB for the spread of the process's own peak and of the libraries' baseline from
# run to run (each moved by ~2 MiB between identical runs of a 96 MiB budget test on a busy 2-core
# machine, enough to cross the budget by 1 MiB with 24 MiB).
RUNTIME_RESERVE = KERNEL_CACHE_BYTES + (4 << 20)
TRAINING_RESERVE = KERNEL_CACHE_BYTES + (10 << 20)
# With a GPU computing, CUDA loads each kernel's module into host memory on its first use: the
# baseline's tiny model touches few of the kernels a real batch selects (Qwen2.5-0.5B at 8x1024
# tokens in bf16 on an H100 peaked 164 MiB beyond its --cpu-mem 6GiB without this reserve).
GPU_HOST_RESERVE = 256 << 20


def flag_bytes(n: float) -> str:
    """`n` bytes rounded up to a whole MiB as the flag takes it (fmt_bytes can write 1.02e+03 MiB)."""
    return f"{-(-int(n) // (1 << 20))}MiB"


class WindowSize(NamedTuple):
    want: int   # the window that never waits for room to read ahead
    floor: int  # the least that runs: a block pinned and the next one read


def window_size(blocks: list[dict[str, int]], prefetch: int) -> WindowSize:
    """The weight window a step needs, from each block's weights (name -> bytes, in forward order).

    A step uses the blocks forward, 0..N, then backward, N..1 (the embedding has no backward use;
    reading it at the end of backward is the next forward's read-ahead), and the window holds the
    block computing, the `prefetch` blocks ahead and one spare: the largest sum of any prefetch + 2
    neighbours in that cycle, a tied weight counted once. Sizing it as prefetch + 2 of the largest
    block instead gave Qwen2.5-0.5B (a 545 MB embedding, tied to the head, and 60 MB layers, fp32)
    2.2 GB where 0.73 GB is used; what is left over goes to activations and optimizer state, which
    save recomputation and reads, where a larger window only saves re-reading weights."""
    cycle = list(range(len(blocks))) + list(range(len(blocks) - 2, 0, -1))

    def widest(k: int) -> int:
        best = 0
        for i in range(len(cycle)):
            names: dict[str, int] = {}
            for j in range(min(k, len(cycle))):
                names.update(blocks[cycle[(i + j) % len(cycle)]])
            best = max(best, sum(names.values()))
        return best
    return WindowSize(widest(prefetch + 2), widest(2))


@dataclass(frozen=True)
class Needs:
    """What a step's working set is made of, in bytes, for `plan_split` to divide a budget between.

    window: `window_size()` of the model's blocks. max_block_grad: the largest block's gradient;
    optimizer_item: one optimizer shard's buffers; layer_act, layer_input: one decoder layer's saved
    activations and its input, n_layers of each; logits: what the head and the loss hold at once.

    held_grad: gradient bytes autograd holds through the whole backward, outside the optimizer's
    hand-off: a tied embedding's gradient from the head waits for the embedding's before the two
    are summed and handed over (on Qwen2.5-0.5B in fp32, 544 MB: without it a run under
    --cpu-mem 4GiB peaked 4.60 GiB beyond the libraries, with it 4.24).

    max_layer_grad: the largest decoder layer's gradient (default: max_block_grad). The gradients'
    share holds the gradients waiting for the optimizer (`Split.pending_grads`) and the block
    backward is making. A block larger than every layer (an embedding: Qwen2.5-0.5B's is 9 layers'
    worth) makes its gradient last, when every kept activation, layer input and the layer's compute
    scratch are free again, so what it needs beyond a layer's is taken from those, not set aside for
    the whole step.

    state_total, weights_total: the bytes of all the optimizer state the cache would hold and of
    all the working weights (page-rounded as their pools hold them). What the state cache has beyond
    the whole state goes to the window, up to every weight: Qwen2.5-0.5B on a GPU under --cpu-mem
    24GiB read its 1.49 GiB of weights back every step with 16 GiB of the budget unused (the
    forward waited ~1 s on them). None: the cache is off, and the window keeps its size."""
    window: WindowSize
    max_block_grad: int
    optimizer_item: int
    layer_act: int
    layer_input: int
    n_layers: int
    logits: int
    held_grad: int = 0
    max_layer_grad: int | None = None
    state_total: int | None = None
    weights_total: int = 0

    @property
    def layer_grad(self) -> int:
        """The largest decoder layer's gradient, never more than the largest block's."""
        return min(self.max_layer_grad or self.max_block_grad, self.max_block_grad)

    @property
    def inputs(self) -> int:
        """Every layer's input, held apart from the activations' share."""
        return self.n_layers * self.layer_input

    @property
    def freed_at_end(self) -> int:
        """What backward has freed when the largest block's gradient is made, beside the
        activations' share (added where it is known)."""
        return 2 * self.layer_act + self.inputs

    @property
    def least_grads(self) -> int:
        """The gradients' share at its smallest: one layer's, or as much of the largest block's as
        the end of backward does not free."""
        return max(self.layer_grad, self.max_block_grad - self.freed_at_end)


def plan_split(budget: int, baseline: int, needs: Needs, reserve: int = TRAINING_RESERVE) -> Split:
    """Divide `budget` (beyond the process `baseline`) between the parts of `needs`: each part's
    generous size where it fits, shrunk in proportion toward its floor where it does not; what is
    left keeps activations, then optimizer state, then weights. Raises BudgetError, naming the
    flag to change, where even the floor does not fit."""
    n = needs
    window, least = n.window
    optimizer = 4 * n.optimizer_item
    # The largest block's worth waiting and, beside it, a layer's in the making, or as much of the
    # largest block's as keeping every layer's activations would not free (a GPU keeps them there).
    grads = n.max_block_grad + max(n.layer_grad, n.max_block_grad - n.freed_at_end - n.n_layers * n.layer_act)
    compute = 2 * n.layer_act + n.logits + reserve + n.held_grad
    _check_floor(budget, baseline, n, least, compute)
    spare = budget - baseline - compute - n.inputs
    window, optimizer, grads = _shrink_to_fit(spare, n, (window, optimizer, grads), least)
    # The layer inputs are held apart from the activations' share under every policy: a recomputed
    # layer restarts from its input, and a kept or swapped layer's graph holds its input and its
    # output (the next layer's input) in RAM, whatever its saved tensors are swapped to. Counted in
    # the share as well, a 20-layer model at 4096 tokens (40 MiB of inputs) swapped with a pool
    # 40 MiB larger than the budget had room for.
    acts = max(budget - baseline - window - optimizer - grads - compute - n.inputs, 0)
    # What keeping every layer's activations does not need keeps optimizer state resident instead.
    cache = max(acts - n.n_layers * n.layer_act, 0)
    acts -= cache
    kept = 0
    if n.state_total is not None:
        kept = max(min(cache - n.state_total, n.weights_total), 0)
        window, cache = window + kept, cache - kept
    # waiting + the one in the making fit the share while layers run, and fit the share and what
    # backward has freed when the largest block's gradient is made
    pending = max(min(grads - n.layer_grad, grads + acts + n.freed_at_end - n.max_block_grad), 0)
    return Split(budget, baseline, window, optimizer, grads, acts, compute, cache, pending, n.held_grad, kept)


def _check_floor(budget: int, baseline: int, n: Needs, least: int, compute: int) -> None:
    """The smallest workable split: two blocks of weights, one optimizer shard, the least
    gradients, the layer inputs and the compute share; BudgetError with the flag where it does
    not fit."""
    floor = baseline + least + n.optimizer_item + n.least_grads + n.inputs + compute
    if floor > budget:
        raise BudgetError(
            f"--cpu-mem {fmt_bytes(budget)} cannot hold the working set: at least {fmt_bytes(floor)} "
            f"is needed (process baseline {fmt_bytes(baseline)}, 2 blocks of weights "
            f"{fmt_bytes(least)}, one optimizer shard {fmt_bytes(n.optimizer_item)}, "
            f"one block of gradients {fmt_bytes(n.least_grads)}, layer inputs "
            f"{fmt_bytes(n.inputs)}, compute, logits and kernel scratch {fmt_bytes(compute)}). "
            f"Raise --cpu-mem to {flag_bytes(floor * 1.1)} or more, or lower --batch-size / --seq-len.")


def _shrink_to_fit(spare: int, n: Needs, sizes: tuple[int, int, int], least: int) -> tuple[int, int, int]:
    """The window, optimizer and gradients' generous sizes, or, where together they pass `spare`,
    each shrunk toward its floor by the same fraction (keeping their proportions)."""
    window, optimizer, grads = sizes
    if window + optimizer + grads <= spare:
        return sizes
    mins = least + n.optimizer_item + n.least_grads
    f = (spare - mins) / max(window + optimizer + grads - mins, 1)
    return (least + int(f * (window - least)), n.optimizer_item + int(f * (optimizer - n.optimizer_item)),
            n.least_grads + int(f * (grads - n.least_grads)))


# cuBLAS workspaces, the caching allocator's rounding and fragmentation, kernels' scratch
GPU_RESERVE = 512 << 20
# Layers' worth of activations on the GPU beside the kept ones at a step's worst moment, a swapped
# layer's backward (engine/act_engine.py, engine/activations.py): its saved tensors copied back
# (a recomputed layer's, made again), the gradients its backward makes through them (counted as
# many bytes, as the CPU split counts them), and the layer below's swapped tensors, copied back on
# the side stream one layer ahead so that they cross the host link while this one computes. A kept
# layer's own are in the allowance. Forward holds less: the layer computing's activations in the
# making (its copies out land, and release their device memory, by the end of its forward).
GPU_LAYERS_IN_FLIGHT = 3


def plan_gpu(budget: int, max_block_weight: int, max_block_grad: int, layer_act: int, layer_input: int,
             n_layers: int, logits: int, held_grad: int) -> int:
    """With a GPU computing: what `--gpu-mem` leaves for kept activations after its fixed share:
    the block computing, the one uploaded ahead and a spare, one block's gradients before they
    are copied out, the layer inputs, GPU_LAYERS_IN_FLIGHT layers' activations beside the kept
    ones, the logits, a tied head's held gradient and the runtime's reserve."""
    acts = GPU_LAYERS_IN_FLIGHT * layer_act
    fixed = (3 * max_block_weight + 2 * max_block_grad + n_layers * layer_input + acts + logits
             + held_grad + GPU_RESERVE)
    if fixed > budget:
        raise BudgetError(
            f"--gpu-mem {fmt_bytes(budget)} cannot hold the GPU's working set: at least {fmt_bytes(fixed)} "
            f"(3 blocks of weights {fmt_bytes(3 * max_block_weight)}, layer inputs "
            f"{fmt_bytes(n_layers * layer_input)}, {GPU_LAYERS_IN_FLIGHT} layers' activations in flight, "
            f"logits and reserve {fmt_bytes(acts + logits + held_grad + GPU_RESERVE)}). Raise --gpu-mem, "
            f"or lower --batch-size / --seq-len.")
    return budget - fixed


# How Adam's moments are stored (--optim-states; engine/state_quant.py encodes them): int8 keeps a
# code a value and an fp32 absmax a block of BLOCK values, for m and v each.
MODES = ("fp32", "bf16", "int8")
BLOCK = 2048


def check_mode(mode: str, what: str = "optim_states") -> str:
    if mode not in MODES:
        raise ValueError(f"{what} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def moment_bytes_per_param(mode: str) -> float:
    """Bytes of m and v together per parameter, as stored (int8: codes plus the block scales)."""
    return {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 8.0 / BLOCK}[check_mode(mode)]
