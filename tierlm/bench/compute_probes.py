"""Compute probes: matmul throughput per dtype, the AdamW kernel the optimizer runs, a reference
decoder layer's forward + backward, and the CRC32C rate every stored byte pays."""
from __future__ import annotations

import time

import torch

from ..precision import resolve
from ..storage.records import checksum
from .timing import GB, best_seconds


def bench_compute(seconds_per_dtype: float = 2.0, n: int = 2048) -> dict:
    """Matmul TFLOPS per dtype (n x n x n), and fused AdamW elements/s on one 4M-element shard."""
    out, sizes = {}, {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # A CPU without bf16/fp16 matrix instructions runs a fallback kernel ~100x slower than fp32
        # (one 2048^3 product: about a minute); a small product first says which size fits the time.
        k = 512
        a, b = torch.randn(k, k).to(dtype), torch.randn(k, k).to(dtype)
        a @ b
        t0 = time.perf_counter()
        a @ b
        small = time.perf_counter() - t0
        k = n if small * (n / k) ** 3 < seconds_per_dtype / 2 else k
        a, b = torch.randn(k, k).to(dtype), torch.randn(k, k).to(dtype)
        a @ b  # kernel selection and page faults outside the timing
        reps, t0 = 0, time.perf_counter()
        while reps < 2 or time.perf_counter() - t0 < seconds_per_dtype:
            a @ b
            reps += 1
        out[str(dtype).removeprefix("torch.")] = 2.0 * k**3 * reps / (time.perf_counter() - t0) / 1e12
        sizes[str(dtype).removeprefix("torch.")] = k
    from torch.optim.adamw import adamw

    k = 1 << 22
    p, g, m, v = (torch.randn(k) for _ in range(4))
    v.abs_()
    step = torch.tensor(1.0)

    def update():
        adamw([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
              amsgrad=False, maximize=False, fused=True, foreach=False)
    update()
    t = best_seconds(update, 10)
    return {"matmul_tflops": out, "matmul_n": n, "matmul_n_by_dtype": sizes, "adamw_elems_per_s": k / t,
            "threads": torch.get_num_threads()}


# Decoder layers unrelated to any model benchmarked (llama-style, heads of 64, a quarter as many KV
# heads, SwiGLU 8/3 x hidden), at octave widths and two token counts: a CPU layer's FLOP rate grows with
# its matrices' width and with the rows they multiply (a 256-row product keeps the cores' caches
# busier per FLOP than a 2048-row one), so the planner interpolates in both (log-log) and clamps outside.
# The rate saturates with width (concave in log-log): between 512 and 2048 alone, a 1024-wide layer's
# rate came out ~12% low (a 2-vCPU Zen 4 VM, bf16, three probes), hence the middle octave.
REF_HIDDEN = (512, 1024, 2048)
REF_TOKENS = (256, 2048)
REF_SEQ = 256


def ref_layer_config(hidden: int) -> dict:
    return dict(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_attention_heads=hidden // 64,
                num_key_value_heads=max(1, hidden // 256), vocab_size=128, num_hidden_layers=1)


def layer_train_flops(layer_params: int, tokens: int, seq: int, q_dim: int) -> float:
    """Forward + backward of one layer: 6 x parameters x tokens + 3 x causal attention (the planner's count)."""
    return 6.0 * layer_params * tokens + 3 * 4.0 * (seq / 2) * q_dim * tokens


def bench_layer(dtype: torch.dtype | None = None, repeats: int = 3, widths: tuple[int, ...] = REF_HIDDEN,
                tokens: tuple[int, ...] = REF_TOKENS) -> dict:
    """FLOP/s of a decoder layer's forward + backward per token count (rows of REF_SEQ) and width, in
    `dtype` (default: what `--precision auto` trains in here): the matmuls at real shapes plus the
    norms, rotary embedding, attention and activation functions around them. `layer_tflops` keeps
    the largest token count's row (what caches from before the token axis held).

    Each shape's best of `repeats` rounds, the rounds interleaved across shapes: on a 2-vCPU Zen 4 VM a
    shape timed `repeats` times in a row still came out 27% slow when a slow spell of a few seconds
    covered it (while the shapes around it were not)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype is None:
        dtype = torch.bfloat16 if resolve("auto")[0] == "bf16" else torch.float32

    shapes = []  # (hidden, tokens, FLOPs, step)
    for hidden in widths:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **ref_layer_config(hidden))).to(dtype)
        layer = model.model.layers[0]
        n = sum(p.numel() for p in layer.parameters())
        for count in tokens:
            rows = max(1, count // REF_SEQ)
            x = torch.randn(rows, REF_SEQ, hidden, dtype=dtype, requires_grad=True)
            pos = torch.arange(REF_SEQ)[None].expand(rows, -1)
            pe = model.model.rotary_emb(x, pos)

            def step(layer=layer, x=x, pe=pe, pos=pos):
                y = layer(x, position_embeddings=pe, attention_mask=None, position_ids=pos)
                (y[0] if isinstance(y, tuple) else y).float().sum().backward()
            step()  # warm-up: first-call allocations and kernel selection
            shapes.append((hidden, count, layer_train_flops(n, rows * REF_SEQ, REF_SEQ, hidden), step))
    best = [float("inf")] * len(shapes)
    for _ in range(repeats):
        for i, (_, _, _, step) in enumerate(shapes):
            best[i] = min(best[i], best_seconds(step, 1))
    table: dict[str, dict[str, float]] = {str(t): {} for t in tokens}
    for (hidden, count, flops, _), t in zip(shapes, best):
        table[str(count)][str(hidden)] = flops / t / 1e12
    top = str(max(tokens))
    return {"layer_tflops": table[top], "layer_tokens": max(tokens), "layer_tflops_by_tokens": table,
            "layer_dtype": "bf16" if dtype == torch.bfloat16 else "fp32"}


def bench_checksum(size_bytes: int = 64 << 20, repeats: int = 5) -> dict:
    """CRC32C bytes/s: every byte the store reads or writes is checksummed on the CPU, on the same
    cores as the compute when there is no GPU."""
    buf = torch.randint(0, 256, (size_bytes,), dtype=torch.uint8).numpy().tobytes()
    t = best_seconds(lambda: checksum(buf), repeats)
    return {"crc32c_gbps": size_bytes / t / GB}
