"""The store's requests in flight, the optimizer's shard size (the size of most requests) and the
weight window's read-ahead: picked from what `tierlm bench io` and `tierlm bench compute` measured
(handed in as data: `tierlm.bench.rates`) and the model, and printed with where they came from. Each is a timing, so each may
only tune what does not change bits: how many bytes are in flight and when, never which bytes a
step computes (the shard size, where it could, comes from the budget: `shard_size`).

Read-ahead: a layer's read must land before the compute reaches it. When the step is
compute-bound and a layer reads faster than its forward computes, reading one layer ahead is
enough on average, and the drive's slow requests decide the rest: the blocks ahead must cover a
read plus the spread between a typical and a slow request (`bench io`'s p50 and p99). When the
step's SSD traffic (weights, and the optimizer's states both ways) outlasts its compute, it waits on
the drive whatever the depth: two layers ahead keep the drive queued, and every block further
would only take RAM from the optimizer-state cache (I/O-bound on a 2-vCPU AMD EPYC Zen 4,
--prefetch 3 or 4 against 2: Qwen2.5-0.5B 6.20-6.55 against 5.92-6.71 s a step, TinyLlama within
the noise too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .budget import shard_elems_for

DEFAULT_IO_THREADS = 4
DEFAULT_READ_AHEAD = 2
MAX_READ_AHEAD = 4  # each block further is a layer of window taken from the state cache


def io_depth(asked: int | None, io: dict | None) -> tuple[int, str]:
    """Requests the store keeps in flight, and where the number comes from. io: `bench io`'s
    measurement of the drive the run writes to, or None."""
    if asked is not None:
        return asked, "set"
    if io and io.get("queue_depth"):
        return int(io["queue_depth"]), "bench io's pick"
    return DEFAULT_IO_THREADS, "default; `tierlm bench io` measures it"


def shard_size(asked: int | None, io: dict | None, budget: int, committed: int | None,
               grad_accum: int = 1) -> tuple[int, str]:
    """Elements in an optimizer shard, and where the number comes from. A resumed run keeps the
    size its committed state was cut in (`committed`, whatever bench io measured since, or
    --cpu-mem now).

    bench io's pick is a timing, so it may only tune what does not change bits. With one micro-batch
    a step it does not: each gradient's norm is taken whole as backward hands it over, and Adam is
    elementwise (tests/engine/test_exactness.py runs shards of 2048, 4096 and the default against
    one reference). With gradient accumulation a tensor split across shards has its norm combined
    from shard norms (optim_norms: equal to within rounding), so there the size comes from the
    budget alone."""
    if asked is not None:
        return asked, "set"
    if committed:
        return int(committed), "the committed state's"
    if grad_accum > 1:
        return shard_elems_for(budget), ("default: with --grad-accum > 1 the shard size can change the "
                                         "clip norm's rounding, so it is not taken from a timing")
    if io and io.get("shard_bytes"):
        want = int(io["shard_bytes"]) // 4  # a fp32 master shard's bytes
        n = shard_elems_for(budget, want)
        return n, "bench io's pick" if n == want // 2048 * 2048 else "bench io's pick, cut to fit --cpu-mem"
    return shard_elems_for(budget), "default; `tierlm bench io` measures it"


def compute_rate(compute: dict | None, precision: str, hidden: int, tokens: int) -> float | None:
    """FLOP/s of a decoder layer's products at this width and micro-batch: `bench compute`'s layer
    probe nearest in tokens and width when it ran in this precision, else its square matmul."""
    if not compute:
        return None
    by_tokens = compute.get("layer_tflops_by_tokens")
    if compute.get("layer_dtype", "bf16") == precision and isinstance(by_tokens, dict) and by_tokens:
        row = by_tokens[min(by_tokens, key=lambda t: abs(math.log(int(t) / max(tokens, 1))))]
        if row:
            width = min(row, key=lambda h: abs(math.log(int(h) / max(hidden, 1))))
            return float(row[width]) * 1e12
    tf = (compute.get("matmul_tflops") or {}).get("bfloat16" if precision == "bf16" else "float32")
    return float(tf) * 1e12 if tf else None


def pick_read_ahead(read_s: float, compute_s: float, spread_s: float, step_io_s: float, step_compute_s: float) -> int:
    """Blocks read ahead of the one computing. read_s: one layer's weights at the measured read
    rate; compute_s: its forward; spread_s: the drive's slow request past a typical one;
    step_io_s, step_compute_s: a layer's share of the step's SSD traffic (weights and optimizer
    state, both ways) and of its compute (forward and backward)."""
    if step_io_s >= step_compute_s or read_s >= compute_s:
        return DEFAULT_READ_AHEAD
    return max(DEFAULT_READ_AHEAD, min(MAX_READ_AHEAD, 1 + math.ceil((read_s + spread_s) / compute_s)))


@dataclass(frozen=True)
class LayerWork:
    """A decoder layer's step, as the read-ahead sees it. weight_bytes: a working weight's bytes a
    parameter; step_bytes: what a step reads and writes on the SSD a parameter (weights and
    optimizer state, no state cache); tokens: a micro-batch's, `micros` of them a step."""
    layer_params: int
    weight_bytes: int
    step_bytes: tuple[float, float]
    tokens: int
    micros: int
    precision: str
    hidden: int
    on_gpu: bool


def read_ahead(asked: int | None, io: dict | None, compute: dict | None, work: LayerWork) -> tuple[int, str]:
    """The weight window's read-ahead in blocks, and where the number comes from. io, compute:
    `bench io`'s and `bench compute`'s measurements, or None."""
    if asked is not None:
        return asked, "set"
    if work.on_gpu:  # bench compute measures the CPU's products
        return DEFAULT_READ_AHEAD, "default with a GPU computing"
    layer_params, weight_bytes, step_bytes = work.layer_params, work.weight_bytes, work.step_bytes
    tokens, micros = work.tokens, work.micros
    flops = compute_rate(compute, work.precision, work.hidden, tokens)
    if not io or not io.get("read_gbps") or not io.get("write_gbps") or not flops:
        return DEFAULT_READ_AHEAD, "default; `tierlm bench io` and `tierlm bench compute` measure it"
    rd, wr = io["read_gbps"] * 1e9, io["write_gbps"] * 1e9
    read_s = layer_params * weight_bytes / rd
    compute_s = 2 * layer_params * tokens / flops
    step_io_s = layer_params * (step_bytes[0] / rd + step_bytes[1] / wr)
    p50, p99 = io.get("read_ms_p50"), io.get("read_ms_p99")
    spread_s = max(0.0, (p99 - p50) / 1e3) if p50 is not None and p99 is not None else 0.0
    step_compute_s = 3 * compute_s * micros  # backward is twice the forward
    depth = pick_read_ahead(read_s, compute_s, spread_s, step_io_s, step_compute_s)
    if step_io_s >= step_compute_s:
        return depth, (f"I/O-bound: a layer's SSD traffic takes {step_io_s * 1e3:.0f} ms a step at "
                       f"{io['read_gbps']:.2f} / {io['write_gbps']:.2f} GB/s, its compute {step_compute_s * 1e3:.0f} ms "
                       f"at {flops / 1e12:.2f} TFLOP/s; further only takes RAM")
    return depth, (f"a layer reads in {read_s * 1e3:.0f} ms at {io['read_gbps']:.2f} GB/s and computes forward in "
                   f"{compute_s * 1e3:.0f} ms at {flops / 1e12:.2f} TFLOP/s, slow reads {spread_s * 1e3:.0f} ms later")
