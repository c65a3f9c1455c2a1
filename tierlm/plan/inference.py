"""An inference run's options and where its weights live under `--cpu-mem`: which decoder layers stay
resident, the stream window, the KV cache and the compute scratch. Pure arithmetic, shared by
`tierlm generate`/`serve` (tierlm.infer.engine executes the placement) and `tierlm plan`."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..hf import fields
from ..precision import cpu_has_bf16_matmul
from ..storage import BudgetError
from ..units import fmt_bytes, parse_bytes
from . import budget as B

DTYPE_NAMES = ("bf16", "fp32")
WEIGHTS = ("auto", "bf16", "fp32", "int8", "int4")


@dataclass
class InferConfig:
    cpu_mem: int | str = "4GiB"
    dtype: str = "bf16"              # compute dtype (and the KV cache's): bf16 | fp32
    weights: str = "auto"            # auto (the compute dtype) | bf16 | fp32 | int8 | int4
    nvme_dir: str | None = None      # the streamed layers' store; default: runs/infer-store/<model>
    max_batch: int = 1               # KV-cache slots: sequences decoded together
    max_seq_len: int | None = None   # positions per slot; default: the model's, at most 2048
    step_tokens: int = 256           # prompt tokens per forward (longer prompts prefill in chunks)
    prefetch: int = 2                # streamed layers read ahead of the one computing
    resident_layers: int | None = None  # None: as many as fit; fewer forces streaming
    io_threads: int = 4
    direct_io: bool | None = None
    threads: int | None = None       # compute threads (torch.set_num_threads); None: torch's default
    tp: int = 1                      # tensor-parallel processes (torchrun); this one holds 1/tp of each layer
    lean: bool = True                # decode steps of llama-family models on tierlm.infer.lean
    fused: bool = True               # ... each layer of them in one C call (tierlm.infer.fused)
    packed: bool = True              # rows of different lengths in one step run unpadded (infer.packed)
    expert_policy: str = "lfu"       # which streamed experts the expert cache keeps: lfu | lru
    device: str = "cpu"              # where layers compute: cpu, cuda[:N] or auto (the recipe's default)
    gpu_mem: int | str | None = None  # device memory the run may use; None: 90% of what is free at start
    # the device's layer schedule (plan.device_placement, infer.device_layers) on the CPU too, with
    # synchronous copies: the tests run its ordering where there is no GPU
    device_schedule: bool = False
    host_resident_layers: int | None = None  # with a device: host layers kept in RAM (None: as fit)

    def __post_init__(self):
        self.cpu_mem = parse_bytes(self.cpu_mem, "--cpu-mem")
        if self.weights in ("bf16", "fp32"):
            self.dtype = self.weights
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"--weights must be one of bf16, fp32, int8, int4, got {self.weights!r}")
        for name in ("max_batch", "step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.prefetch < 0:
            raise ValueError("--prefetch must be >= 0")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1 (processes sharing each layer), got {self.tp}")
        if self.gpu_mem is not None:
            self.gpu_mem = parse_bytes(self.gpu_mem, "--gpu-mem")
            if self.gpu_mem <= 0:
                raise ValueError(f"--gpu-mem must be a size above 0, got {self.gpu_mem}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1 (compute threads), got {self.threads}")

    @property
    def quant(self) -> str | None:
        return self.weights if self.weights in ("int8", "int4") else None


@dataclass
class Placement:
    budget: int
    baseline: int
    fixed: int          # embeddings, final norm, head
    kv: int
    scratch: int
    layer_bytes: int    # the largest decoder layer
    layers: int
    resident: int       # decoder layers kept in RAM
    window: int         # stream window pool (0 when every layer is resident)
    kv_name: str = "KV cache"  # what `kv` holds (cache_name)

    @property
    def streamed(self) -> int:
        return self.layers - self.resident

    def describe(self) -> str:
        return (f"{self.resident}/{self.layers} layers resident, {self.streamed} streamed; budget "
                f"{fmt_bytes(self.budget)} = baseline {fmt_bytes(self.baseline)} + embeddings/head "
                f"{fmt_bytes(self.fixed)} + layers {fmt_bytes(self.resident * self.layer_bytes)} + stream window "
                f"{fmt_bytes(self.window)} + {self.kv_name} {fmt_bytes(self.kv)} + compute {fmt_bytes(self.scratch)}")


def scratch_bytes(config, cfg: InferConfig, max_len: int, dtype=None, eager: bool = False,
                  packs: bool = True) -> int:
    """Transient memory of one forward of `step_tokens` tokens (an upper estimate): a layer's
    activations in fp32, attention scores over the whole cache, the logits, the kernels' caches,
    and the fused decode layer's buffers."""
    h = config.hidden_size
    inter = fields.intermediate(config, 4 * h)
    heads = fields.widest(config, "heads", 0)  # none in a state-space model (Mamba); any layer's most
    # a step feeds at most step_tokens of prompts beside one token of every other row; padded
    # (packed=False, or a model whose attention runs padded rows: packed.install), every row is as
    # long as the longest prompt chunk
    tokens = cfg.step_tokens + cfg.max_batch if cfg.packed and packs else cfg.step_tokens * cfg.max_batch
    act = tokens * (12 * h + 4 * inter) * 4
    if cfg.quant == "int4" or upcasts_bf16(cfg):  # a prefill multiplies one matrix at a time in fp32
        act += 4 * largest_matrix(config, cfg.max_batch)
    scores = tokens * heads * (max_len + 1) * 4
    # the step's boolean masks, one a kind of layer (full, sliding, chunked)
    kinds = len({str(t) for t in getattr(config, "layer_types", None) or ["full"]})
    masks = tokens * (max_len + 1) * kinds
    if eager:  # the model's eager attention (packed.py): the scores, soft-capped, their fp32 softmax, its
        scores *= 3  # cast; and the masks made additive, in the compute dtype (at most fp32)
        masks *= 5
    logits = cfg.max_batch * config.vocab_size * 4 * 3
    # the fused decode layer's buffers (kernels/layer.c), kept between steps: a row's x, q/k/v,
    # attention, gate/up, silu and their integer roundings, and each thread's scores
    fused = cfg.max_batch * (7 * h + 4 * inter) * 4 + (os.cpu_count() or 1) * (max_len + 1) * 4
    return act + scores + masks + logits + fused + B.RUNTIME_RESERVE


# From this many rows a bf16 product converts its weight to fp32 where the CPU has no bf16 units
# (infer.gemv, which measured the threshold; infer.fp32_product converts)
UPCAST_MIN_ROWS = 16


def upcasts_bf16(cfg: InferConfig) -> bool:
    """Whether many-row products convert bf16 weights to fp32 (`infer.fp32_product`): on a CPU
    without bf16 matrix instructions, where the layers compute there."""
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    return cfg.dtype == "bf16" and cfg.quant is None and on_cpu and not cpu_has_bf16_matmul()


def largest_matrix(config, rows: int) -> int:
    """Elements of the largest matrix a many-row product converts: a decoder layer's widest linear
    map, and the head's where `rows` sequences decode together in one step."""
    h = config.hidden_size
    inter = fields.intermediate(config, 4 * h)
    heads = fields.get(config, "heads") or 0  # none in a state-space model (Mamba)
    widest = max(inter, h, heads * fields.head_dim(config) if heads else 0) * h
    return max(widest, config.vocab_size * h) if rows >= UPCAST_MIN_ROWS else widest


def cache_name(kv: int, states: int) -> str:
    """What a model's cache holds, by its bytes of keys and values and of recurrent states (a
    state-space or linear-attention layer's conv and recurrent states)."""
    if states and kv:
        return "KV cache and recurrent states"
    return "recurrent states" if states else "KV cache"


def plan_placement(cfg: InferConfig, baseline: int, fixed: int, layer_bytes: int, layers: int,
                   kv: int, scratch: int, kv_name: str = "KV cache") -> Placement:
    avail = cfg.cpu_mem - baseline - fixed - kv - scratch
    want = cfg.resident_layers if cfg.resident_layers is not None else layers
    want = max(0, min(want, layers))
    if want == layers and layers * layer_bytes <= avail:
        return Placement(cfg.cpu_mem, baseline, fixed, kv, scratch, layer_bytes, layers, layers, 0, kv_name)
    window = (cfg.prefetch + 1) * layer_bytes
    if avail < window:
        need = cfg.cpu_mem - avail + window
        raise BudgetError(
            f"--cpu-mem {fmt_bytes(cfg.cpu_mem)} cannot run this model: at least {fmt_bytes(need)} is needed "
            f"(process baseline {fmt_bytes(baseline)}, embeddings and head {fmt_bytes(fixed)}, {kv_name} "
            f"{fmt_bytes(kv)} for --max-batch {cfg.max_batch} x --max-seq-len, compute {fmt_bytes(scratch)}, "
            f"a stream window of {cfg.prefetch + 1} layers {fmt_bytes(window)}). Raise --cpu-mem to "
            f"{fmt_bytes(need * 1.05)}, or lower --max-batch / --max-seq-len / --step-tokens / --prefetch, "
            f"or use --weights int8 or int4")
    resident = min(want, max(0, (avail - window) // max(layer_bytes, 1)))
    return Placement(cfg.cpu_mem, baseline, fixed, kv, scratch, layer_bytes, layers, int(resident), window, kv_name)
