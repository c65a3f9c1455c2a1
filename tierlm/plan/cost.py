"""The cost model: FLOPs and bytes of a step, and the rates each resource moves them at.

Everything here is arithmetic on a ModelShape and a Hardware; the planner (`planner.py`) decides the
placement and combines the resource times. Formulas and assumptions are named where they are used,
so a reader can check every number the plan prints.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

from .budget import layer_activation_bytes as engine_estimate
from .catalog import GB, Hardware
from .shapes import ModelShape


@dataclass(frozen=True)
class Efficiency:
    """Fraction of a datasheet peak a real run sustains, per class of resource, the same for every
    part of the class (never tuned per part or per case). Measured rates (`--hardware this`) are
    what tierlm itself reached, so they get 1.0.

    gpu_compute 0.75: large bf16 GEMMs reach 80-90% of the tensor-core peak; attention, norms and
        activation functions in the same step run well below it.
    cpu_compute 0.60: AMX / AVX-512 GEMMs in oneDNN at all-core clocks, below the base-clock peak
        once the vector units throttle, plus the non-GEMM share of the step.
    memory 0.75: STREAM-style copy bandwidth is 70-80% of the channels' theoretical rate.
    link 0.80: PCIe payload after TLP/DLLP overhead with large pinned transfers.
    nvme 0.85: a RAID-0 of drives with direct I/O and large blocks, against the vendors' sequential
        numbers (measured at 128 KiB, high queue depth, fresh drive).
    """
    gpu_compute: float = 0.75
    cpu_compute: float = 0.60
    memory: float = 0.75
    link: float = 0.80
    nvme: float = 0.85

    def to_json(self) -> dict:
        return asdict(self)


# Fused AdamW elements per second per core on a catalog CPU: the update is memory-bound, ~1e9
# elements/s per core on AVX-512 parts with the bytes in cache (assumption; `bench compute` measures
# it on the machine at hand and replaces it).
ADAM_ELEMS_PER_CORE = 1.0e9

# Bytes per parameter in tierlm's layout (bf16 precision): working weights, fp32 master + Adam m, v,
# and the bf16 gradient the optimizer consumes and saves for an exact clip redo.
W_BYTES, OPT_BYTES, GRAD_BYTES = 2, 12, 2
# Through the SSD per step for a parameter whose state lives there (the planner's `_Layout`, per
# precision): weights read in forward and in backward, optimizer state read and written, new working
# weights written (DESIGN.md's ~30 bytes in bf16), the gradient saved when clipping is on, and the
# redo of a step that clips. On disk: state and working weights in two slots (the step reads one and
# writes the other).
# DRAM traffic of the CPU optimizer per parameter: read master, m, v and the gradient, write them
# and the new working weights.
OPT_DRAM_PER_PARAM = OPT_BYTES + GRAD_BYTES + OPT_BYTES + W_BYTES


@dataclass(frozen=True)
class Rates:
    """What each resource sustains, bytes/s or FLOP/s, after the efficiency factors."""
    compute_flops: float      # the compute device (GPU, or the CPU when there is none)
    cpu_flops: float
    adam_elems: float         # CPU optimizer, parameters per second
    dram: float
    link: float               # host <-> GPU per direction; 0 without a GPU
    gpu_mem: float            # GPU memory bandwidth; 0 without a GPU
    ssd_read: float
    ssd_write: float
    gpu_bytes: int
    ram_bytes: int
    nvme_bytes: int
    measured: bool
    # measured only (`tierlm bench compute`): a decoder layer's forward + backward FLOP/s on the CPU,
    # and the engine's fixed costs per step and per layer (overhead.py); zero on catalog hardware,
    # where a real model's large layers make them negligible against the step.
    layer_flops: dict | None = None   # {hidden: FLOP/s} of the reference layers (at their most tokens)
    layer_flops_by_tokens: dict | None = None  # {tokens: {hidden: FLOP/s}}, where measured
    gemv: float = 0.0                 # weight bytes/s of a batch-1 decode step's layers, bf16 weights
    decode: dict | None = None        # the same per weight format ({"bf16", "int8", "int4"}: bytes/s)
    crc: float = 0.0                  # CRC32C bytes/s (the store checksums every byte on the CPU)
    overhead: dict | None = None
    # share of the shorter of CPU compute and SSD time hidden when both run at once on the CPU's
    # cores (bench/overlap.py); 1 on catalog hardware and beside a GPU, where threads that move
    # bytes do not take the compute's cores
    overlap: float = 1.0
    # measured only, for one model and micro-batch (bench.model_step.bench_model_step): seconds of its
    # own decoder layer's forward + backward and of the rest (embedding, head, loss) at `tokens`
    model_step: dict | None = None

    def model_step_s(self, tokens: int) -> tuple[float, float] | None:
        """(one layer's forward + backward, the rest) in seconds, where the model's own step was
        measured at this micro-batch of `tokens`; else None."""
        m = self.model_step
        if not m or int(m.get("tokens", -1)) != int(tokens):
            return None
        return m["layer_s"], m["rest_s"]

    def layer_rate(self, hidden: int, tokens: int | None = None) -> float:
        """A layer's forward + backward FLOP/s at this width and micro-batch of `tokens`: log-log
        between the measured widths, then between the measured token counts, clamped outside
        them; 0 when not measured. Without a token axis (older caches, or `tokens` None) the width
        alone, at the reference layers' token count."""
        if self.layer_flops_by_tokens and tokens:
            rows = sorted((int(t), _loglog(int(hidden), {int(h): v for h, v in row.items()}))
                          for t, row in self.layer_flops_by_tokens.items() if row)
            return _loglog(int(tokens), dict(rows))
        if not self.layer_flops:
            return 0.0
        return _loglog(int(hidden), {int(h): v for h, v in self.layer_flops.items()})

    def to_json(self) -> dict:
        return asdict(self)


def _loglog(x: int, pts: dict[int, float]) -> float:
    """Log-log interpolation of x between the points {x_i: y_i}, clamped outside them."""
    p = sorted(pts.items())
    if x <= p[0][0] or len(p) == 1:
        return p[0][1]
    if x >= p[-1][0]:
        return p[-1][1]
    (x0, y0), (x1, y1) = next((a, b) for a, b in zip(p, p[1:]) if a[0] <= x <= b[0])
    return y0 * (y1 / y0) ** (math.log(x / x0) / math.log(x1 / x0))


def rates(hw: Hardware, eff: Efficiency, precision: str = "bf16") -> Rates:
    m = hw.measured
    if m is not None:
        dtype = "bfloat16" if precision == "bf16" else "float32"
        cpu_flops = m["matmul_tflops"][dtype] * 1e12
        adam = m["adamw_elems_per_s"]
        dram = m["mem_gbps"] * GB
        rd, wr = m["nvme"]["read_gbps"] * GB, m["nvme"]["write_gbps"] * GB
    else:
        cpu_flops = hw.cpu.bf16_tflops * 1e12 * eff.cpu_compute
        adam = hw.cpu.cores * ADAM_ELEMS_PER_CORE
        dram = hw.cpu.mem_gbps * GB * eff.memory
        rd, wr = hw.nvme_read_gbps * GB * eff.nvme, hw.nvme_write_gbps * GB * eff.nvme
    g = hw.gpu
    bf16 = m is not None and precision == "bf16"
    # the reference layers ran in one dtype (caches from before it was recorded: bf16)
    same = m is not None and m.get("layer_dtype", "bf16") == precision
    layer = m.get("layer_tflops") if same else None
    by_tokens = m.get("layer_tflops_by_tokens") if same else None
    return Rates(layer_flops={h: v * 1e12 for h, v in layer.items()} if isinstance(layer, dict) else None,
                 layer_flops_by_tokens={t: {h: v * 1e12 for h, v in row.items()} for t, row in by_tokens.items()}
                 if isinstance(by_tokens, dict) else None,
                 # measured on bf16 weights (inference's default), whatever finetune's precision
                 gemv=_decode_rates(m).get("bf16", 0.0) if bf16 else 0.0,
                 decode=_decode_rates(m) if bf16 else None,
                 crc=(m.get("crc32c_gbps") or 0.0) * GB if m is not None else 0.0,
                 overhead=m.get("overhead") if m is not None else None,
                 overlap=m.get("overlap", 1.0) if m is not None and m.get("overlap") is not None else 1.0,
                 # in the dtype this precision computes in
                 model_step=(m.get("model_step") if m is not None and (m.get("model_step") or {}).get("dtype")
                             == ("bfloat16" if precision == "bf16" else "float32") else None),
                 compute_flops=(g.tflops * 1e12 * eff.gpu_compute) if g else cpu_flops, cpu_flops=cpu_flops,
                 adam_elems=adam, dram=dram, link=g.link_gbps * GB * eff.link if g else 0.0,
                 gpu_mem=g.mem_gbps * GB * eff.memory if g else 0.0, ssd_read=rd, ssd_write=wr,
                 gpu_bytes=g.memory_bytes if g else 0, ram_bytes=hw.ram_bytes, nvme_bytes=hw.nvme_bytes,
                 measured=m is not None)


def _decode_rates(m: dict | None) -> dict:
    """Measured batch-1 decode rates by weight format (bytes/s): `bench compute`'s decode step
    through layers on the engine's path; caches from before it measured formats have one bf16
    product rate (`gemv_gbps`)."""
    if m is None:
        return {}
    if m.get("decode_gbps"):
        return {k: v * GB for k, v in m["decode_gbps"].items()}
    return {"bf16": m["gemv_gbps"] * GB} if m.get("gemv_gbps") else {}


def weight_bytes_per_param(fmt: str, k: int, group: int = 128) -> float:
    """Bytes a decoder layer's matrix of `k` inputs holds per parameter in a serving format
    (tierlm.infer.quant): bf16; int8 with a bf16 scale per output row; int4 in nibbles with an fp32
    (scale, offset) pair per group of `group` inputs (our kernels' layout)."""
    if fmt == "bf16":
        return float(W_BYTES)
    if fmt == "int8":
        return 1.0 + 2.0 / k
    if fmt == "int4":
        return 0.5 + 8.0 / group
    raise ValueError(f"--weights {fmt!r}: use bf16, int8 or int4")


# ---- FLOPs ----------------------------------------------------------------------------------------

def attention_fwd_flops(s: ModelShape, context: float, tokens: float) -> float:
    """Score and value matmuls of every layer: 2 matmuls x 2 FLOP x context x q_dim per token.
    `context` is the average number of keys a query sees (S/2 for a causal sequence of S, since the
    kernels skip masked blocks)."""
    return 4.0 * context * s.q_dim * s.layers * tokens


def train_flops(s: ModelShape, tokens: int, seq_len: int) -> float:
    """Model FLOPs of one forward + backward: 6 x (matmul parameters) x tokens, plus attention x 3.
    The input embedding is a lookup and costs nothing; recomputation is added by the planner. A
    mixture of experts multiplies by its active parameters (ModelShape.matmul_params), not all."""
    return 6.0 * s.matmul_params * tokens + 3 * attention_fwd_flops(s, seq_len / 2, tokens)


def layer_fwd_flops(s: ModelShape, tokens: int, seq_len: int) -> float:
    """One decoder layer's forward: what recomputing it costs (a mixture of experts: the experts a
    token is routed to)."""
    return 2.0 * s.active_layer_params * tokens + attention_fwd_flops(s, seq_len / 2, tokens) / s.layers


# ---- activation and working-set bytes --------------------------------------------------------------

def hf_like_config(s: ModelShape) -> SimpleNamespace:
    """The config attributes the engine's own estimates read, from a planning shape."""
    return SimpleNamespace(hidden_size=s.hidden, intermediate_size=s.intermediate, num_attention_heads=s.heads,
                           num_key_value_heads=s.kv_heads, vocab_size=s.vocab)


def layer_activation_bytes(s: ModelShape, tokens: int, fused_kernels: bool = False,
                           dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one decoder layer saves for backward, computing in `dtype`.

    tierlm's engine (CPU, transformers' eager modeling code): the engine's own estimate,
    `tierlm.plan.budget.layer_activation_bytes`, so the plan and the run's budget agree. It is what
    autograd really saves: measured with saved_tensors_hooks on a llama layer (hidden 1024,
    intermediate 2816, 8 KV heads), 45.4 KB a token against the engine's 47.1 KB; RMSNorm's fp32
    upcasts, the rotary outputs and the SiLU input are saved too.

    GPU plans (`fused_kernels`): the published systems the catalog is checked against (LoHan)
    run fused norm / attention / activation kernels that save only Korthikanti et al. 2022's
    tensors (section 4.1, without dropout masks: 2 x (4h + 2 q + 2 kv + 2 or 3 i) bytes a token,
    31.2 KB for the layer above). The eager estimate would make GPT-3 175B at batch 16, which LoHan
    ran on a 24 GB RTX 4090, not fit it; so the two must differ."""
    if fused_kernels:
        elems = 4 * s.hidden + 2 * s.q_dim + 2 * s.kv_dim + (3 if s.gated_mlp else 2) * s.intermediate
        return torch.empty((), dtype=dtype).element_size() * elems * tokens
    return engine_estimate(hf_like_config(s), tokens, dtype)


def layer_input_bytes(s: ModelShape, tokens: int, elem: int = 2) -> int:
    """The checkpoint a recomputed layer restarts from (hidden states of `elem` bytes: bf16 2)."""
    return elem * s.hidden * tokens


def compute_working_bytes(s: ModelShape, tokens: int, elem: int = 2) -> int:
    """Transient memory beside the saved activations on the compute device: the widest intermediate
    and its gradient, and the logits computed in chunks (one copy of tokens x vocab), in `elem`-byte
    elements (bf16 2)."""
    return elem * (2 * s.intermediate * tokens + s.vocab * tokens)


def kv_bytes_per_token(s: ModelShape) -> int:
    """bf16 K and V of every layer (latent attention: what it caches instead)."""
    return 2 * s.layers * s.kv_elems
