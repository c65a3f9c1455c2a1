"""The measurements: NVMe sequential bandwidth through tierlm's own store, host memory bandwidth,
matmul throughput per dtype, and the AdamW kernel the optimizer runs.

I/O goes through `TensorStore` (direct I/O where the file system allows it, CRC32C on every tensor,
several requests in flight), so the numbers are what the engine gets, not what `fio` would get.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import psutil
import torch

from ..hf.fields import put
from ..storage import HostBufferPool, TensorStore
from ..storage.aligned import aligned_empty

GB = 1e9


def best_seconds(fn, repeats: int) -> float:
    """The shortest of `repeats` timings of fn() (a probe keeps the quiet moments)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_io(directory: str | os.PathLike, size_bytes: int = 2 << 30, block_bytes: int = 16 << 20,
             inflight: int = 4) -> dict:
    """Write then read `size_bytes` in `block_bytes` tensors with `inflight` requests outstanding.
    The timed writes overwrite files a first pass created, as every step after a run's first
    rewrites its optimizer slot in place (creating files is 2-3x slower: benchmarks/store_writes.py)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < size_bytes * 1.1:
        raise ValueError(f"--nvme {root}: {free / GB:.1f} GB free, the benchmark writes {size_bytes / GB:.1f} GB; "
                         f"free space or pass --size smaller")
    work = root / f".tierlm-bench-{os.getpid()}"
    n = max(1, size_bytes // block_bytes)
    bufs = [aligned_empty(block_bytes) for _ in range(inflight)]
    for b in bufs:  # incompressible bytes: some drives compress zeros
        b.view(torch.uint8).copy_(torch.randint(0, 256, (b.numel(),), dtype=torch.uint8))
    reads: list[float] = []  # each read request's seconds: the read-ahead covers the slow ones
    store = TensorStore(work, HostBufferPool(0, name="bench"), io_threads=inflight,
                        on_event=lambda kind, key, t0, t1, nbytes: reads.append(t1 - t0) if kind == "ssd_read" else None)

    def write_all() -> float:
        t0 = time.perf_counter()
        pending = [None] * inflight
        for i in range(n):
            slot = i % inflight
            if pending[slot] is not None:
                pending[slot].result()
            pending[slot] = store.write(f"b{i}", bufs[slot][:block_bytes])
        for f in pending:
            if f is not None:
                f.result()
        os.sync()  # buffered writes (no direct I/O) count only once on the device
        return time.perf_counter() - t0

    try:
        create_s = write_all()
        write_s = write_all()
        t0 = time.perf_counter()
        pending = [None] * inflight
        for i in range(n):
            slot = i % inflight
            if pending[slot] is not None:
                pending[slot].result()
            pending[slot] = store.read_into(f"b{i}", bufs[slot][:block_bytes], owns_padding=True)
        for f in pending:
            if f is not None:
                f.result()
        read_s = time.perf_counter() - t0
        direct = store.direct
    finally:
        store.close()
        shutil.rmtree(work, ignore_errors=True)
    total = n * block_bytes
    from .cache import mount_point
    return {"dir": str(root.resolve()), "mount": mount_point(root), "direct_io": direct, "bytes": total, "block_bytes": block_bytes,
            "inflight": inflight, "read_gbps": total / read_s / GB, "write_gbps": total / write_s / GB,
            "create_write_gbps": total / create_s / GB,
            "read_ms_p50": 1e3 * _quantile(reads, 0.5), "read_ms_p99": 1e3 * _quantile(reads, 0.99),
            "free_bytes": shutil.disk_usage(root).free,
            "note": None if direct else "no direct I/O here: reads may come from the page cache and overstate the drive"}


# A probe takes at most this share of a drive's free space: the run's own files (optimizer state,
# swapped activations, checkpoints) go to the same folder, and a probe that fills the drive would
# make the run it measures for fail. Below PROBE_FLOOR a measurement says too little to be worth it.
PROBE_SHARE = 8
PROBE_FLOOR = 32 << 20


def probe_size(directory: str | os.PathLike, want: int, block_bytes: int = 16 << 20) -> tuple[int, str]:
    """How many bytes a drive probe may write in `directory`: `want`, cut to 1/PROBE_SHARE of the
    free space there and rounded down to whole blocks; 0 where that leaves less than PROBE_FLOOR.
    Also the reason, in words, for the message that announces or skips the probe."""
    p = Path(directory)
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    size = min(want, free // PROBE_SHARE) // block_bytes * block_bytes
    if size < PROBE_FLOOR:
        return 0, (f"{free / GB:.2f} GB free under {directory}; a drive probe takes at most 1/{PROBE_SHARE} "
                   f"of it and needs {PROBE_FLOOR >> 20} MiB")
    why = f"{size >> 20} MiB" + ("" if size == want // block_bytes * block_bytes else
                                 f" (1/{PROBE_SHARE} of the {free / GB:.2f} GB free)")
    return size, why


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


DEPTHS = (2, 4, 8)


def _fewest_within(*bys: dict[int, dict]) -> int:
    """The smallest key whose read and write rates are all within 5% of the best any key reached
    (in each of `bys`: one measurement per request size); where none is (a noisy drive read best
    at one key and wrote best at another), the key whose worst rate comes closest to its best, the
    smallest of equals."""
    share = {d: 1.0 for d in bys[0]}
    for by in bys:
        best_r = max(max(v["read_gbps"] for v in by.values()), 1e-12)
        best_w = max(max(v["write_gbps"] for v in by.values()), 1e-12)
        for d, v in by.items():
            share[d] = min(share[d], v["read_gbps"] / best_r, v["write_gbps"] / best_w)
    within = [d for d, s in share.items() if s >= 0.95]
    return min(within) if within else min(share, key=lambda d: (-share[d], d))


def pick_queue_depth(*by_size: dict[int, dict]) -> int:
    """The fewest requests in flight whose read and write rates, at each request size measured
    (one table each), are all within 5% of the best any depth reached: more I/O threads than that
    only take CPU from the compute."""
    return _fewest_within(*by_size)


def _interleaved(values, run, rounds: int) -> dict[int, dict]:
    """run(value) -> bench_io's result for each value, in interleaved rounds; best of each."""
    by = {v: {"read_gbps": 0.0, "write_gbps": 0.0} for v in values}
    for _ in range(rounds):
        for v in values:
            r = run(v)
            for k in ("read_gbps", "write_gbps"):
                by[v][k] = max(by[v][k], r[k])
    return by


SMALL_BYTES = 256 << 10  # a k or v projection's bf16 weight (Qwen2.5-0.5B: 224 KiB; TinyLlama: 1 MiB)


def bench_queue_depth(directory: str | os.PathLike, depths=DEPTHS, size_bytes: int = 512 << 20,
                      block_bytes: int = 8 << 20, small_bytes: int = SMALL_BYTES, small_size: int = 128 << 20,
                      rounds: int = 2) -> dict:
    """`bench_io` at each number of requests in flight, in interleaved rounds (best of each), with
    the engine's shard-sized requests (a bf16 weight shard) and with its small ones, and the depth
    the engine should use. The small ones decide on drives like this host's: at 8 MiB two in flight
    read as fast as eight, at 256 KiB 35-40% slower (docs/benchmarks.md), and about a third of a
    step's requests are small ones."""
    by = _interleaved(depths, lambda d: bench_io(directory, size_bytes, block_bytes, inflight=d), rounds)
    small = _interleaved(depths, lambda d: bench_io(directory, small_size, small_bytes, inflight=d), rounds)
    return {"queue_depth": pick_queue_depth(by, small), "depth_block_bytes": block_bytes,
            "by_depth": {str(d): v for d, v in by.items()}, "depth_small_bytes": small_bytes,
            "by_depth_small": {str(d): v for d, v in small.items()}}


BLOCKS = (4 << 20, 8 << 20, 16 << 20, 32 << 20)


def bench_block_size(directory: str | os.PathLike, inflight: int, blocks=BLOCKS, size_bytes: int = 512 << 20,
                     rounds: int = 2) -> dict:
    """`bench_io` at each request size with `inflight` requests outstanding, in interleaved rounds
    (best of each), and the size the engine's optimizer shards should have: the smallest within 5%
    of the best. Smaller shards leave RAM to the state cache (four shards' buffers are in flight);
    a drive that needs larger requests to reach its rate gets them."""
    by = _interleaved(blocks, lambda b: bench_io(directory, size_bytes, b, inflight=inflight), rounds)
    return {"shard_bytes": _fewest_within(by), "by_block": {str(b): v for b, v in by.items()}}


def bench_memory(size_bytes: int = 512 << 20, repeats: int = 5) -> dict:
    """Host memory bandwidth of a large tensor copy (read + write counted), torch's threads."""
    src = torch.empty(size_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = best_seconds(lambda: dst.copy_(src), repeats)
    return {"mem_gbps": 2 * size_bytes / t / GB, "copy_bytes": size_bytes}


READ_K = 4096  # columns of the read probe's int8 matrix: rows of 4 KiB, as a large layer's


def bench_read(size_bytes: int = 512 << 20, repeats: int = 6) -> dict:
    """Host memory read bandwidth the way batch-1 decode reads its weights: our one-row product
    (tierlm.infer.native, the kernels decode runs) over a `size_bytes` int8 matrix, far past the
    last-level cache, in one buffer on huge pages (aligned_empty, as the inference engine's
    install_resident allocates its layers), on torch's threads (which our kernels' OpenMP region
    uses too), int8 and bf16 weights. Each way's best of `repeats`; the rate is the best of the ways tried, PyTorch's
    fp32 sum over the same bytes too (what the kernels fall back on), on one thread and on all:
    the roofline is what the memory can deliver to decode, not the average disturbance of a
    shared machine.

    A generic probe alone (a torch sum on 4 KiB pages) read 10.4 GB/s on a Xeon whose decode
    moved 19.4: a roofline share of 160%, which says the probe is wrong, not the decode."""
    from ..infer import native

    n = max(1, size_bytes // READ_K)
    buf = aligned_empty(n * READ_K)
    w = buf.view(torch.int8).view(n, READ_K)
    w.fill_(1)  # touched: first-touch page faults outside the timings
    ways = {}
    threads = torch.get_num_threads()
    if native.available():
        scales, x = torch.ones(n), torch.ones(1, READ_K)
        ways[f"native int8 one-row product, {threads} threads"] = lambda: native.products(x, [w], [scales])
        wb = buf.view(torch.bfloat16).view(n, READ_K // 2)  # 0x0101: small finite numbers
        xb = torch.ones(1, READ_K // 2)
        ways[f"native bf16 one-row product, {threads} threads"] = lambda: native.products(xb, [wb])
    f32 = buf.view(torch.float32)
    ways[f"torch fp32 sum, {threads} threads"] = lambda: f32.sum()
    if threads > 1:
        def one_thread():
            torch.set_num_threads(1)
            try:
                f32.sum()
            finally:
                torch.set_num_threads(threads)
        ways["torch fp32 sum, 1 thread"] = one_thread
    by = {}
    for name, fn in ways.items():
        fn()  # warm-up: kernel selection, the library's first call
        by[name] = n * READ_K / best_seconds(fn, repeats) / GB
    best = max(by, key=by.get)
    return {"read_gbps": by[best], "read_how": best, "read_gbps_by_way": by, "read_bytes": n * READ_K,
            "read_huge_pages": bool(buf.data_ptr() % (2 << 20) == 0)}


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
        from ..precision import resolve
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


DECODE_FORMATS = ("bf16", "int8", "int4")


def bench_decode(formats=DECODE_FORMATS, hidden: int = 2048, total_bytes: int = 256 << 20, repeats: int = 30,
                 config=None) -> dict:
    """Weight bytes/s of a batch-1 decode step through llama decoder layers on the inference
    engine's own decode path (`tierlm.infer.lean`: each layer one C call where our kernels build),
    per weight format: what the plan divides a decode step's weight bytes by. Far below the
    large-GEMM rate on a CPU, and not one matrix's rate either: the engine's step also normalises,
    rotates, attends and adds between the products.

    Layers of `hidden` (heads of 64, a quarter as many KV heads, SwiGLU of 8/3), as many as make
    `total_bytes` of distinct weights in the format: one layer timed again and again would stay in
    the last-level cache (32 MiB on an EPYC's core complex) and read faster than memory delivers.
    They are copies of one random, quantised layer: the products' speed does not depend on the
    values. Each format's best of `repeats` rounds (~1 s in all), interleaved across the formats:
    one format's rounds back to back took a tenth of a second, and on a 2-vCPU Zen 4 VM the memory rate
    switches between states for seconds at a time (bf16 once probed at 21 GB/s beside int8 at 28,
    35 a run before). A probe still lands in one state: three in a row read 29.6, 36.5, 29.2 GB/s."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from ..infer.kvcache import SlotKVCache
    from ..infer.lean import LeanDecoder, model_refusal
    from ..infer.quant import QLinear, replace_linears

    inter = hidden * 8 // 3 // 64 * 64
    steps, path = {}, None  # format -> (weight bytes, one decode step)
    for fmt in formats:
        if config is not None:
            # a model's own layers (`tierlm plan --task serve --hardware this`): its family's code
            # and shapes; a small vocabulary, since the head is not what is timed here
            from transformers import AutoModelForCausalLM
            cfg = copy.deepcopy(config)
            put(cfg, "layers", 1)
            cfg.vocab_size, cfg.max_position_embeddings = 256, 64
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
            why = model_refusal(model)
            if why:  # timing LeanDecoder on it would leave part of its maths out
                raise ValueError(f"{config.model_type} decodes on the generic path ({why}); this probe times "
                                 "the native one")
        else:
            cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=hidden // 64,
                              num_key_value_heads=max(1, hidden // 256), num_hidden_layers=1, vocab_size=256,
                              max_position_embeddings=64)
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        layer = model.model.layers[0]
        if fmt != "bf16":
            for q, _conv, old in replace_linears(layer, fmt).values():
                for name, t in q.quantize(old.weight.data, None, torch.bfloat16).items():
                    setattr(q, name, t)
        nbytes = sum(t.numel() * t.element_size() for m in layer.modules()
                     for t in ([m.qweight, m.scales] if isinstance(m, QLinear) else
                               [m.weight] if isinstance(m, torch.nn.Linear) else []))
        n = max(2, total_bytes // nbytes)
        model.model.layers = torch.nn.ModuleList([layer] + [copy.deepcopy(layer) for _ in range(n - 1)])
        put(model.config, "layers", n)  # layer_types (Qwen3, Gemma 3) repeated to match
        dec = LeanDecoder(model, torch.bfloat16, None, {})
        cache = SlotKVCache(model.config, 1, 64, torch.bfloat16)
        pos, mask = cache.begin_step([32], [1])
        ids = torch.ones(1, 1, dtype=torch.long)
        step = (lambda dec=dec, cache=cache, pos=pos, mask=mask, ids=ids: dec.logits(ids, pos, mask, cache))
        with torch.no_grad():
            step()  # warm-up
        steps[fmt] = (n * nbytes, step)
        if path is None:
            path = "fused" if dec.fused is not None and dec.fused[0].ready(1) else "per-product"
        del model
    best = dict.fromkeys(steps, float("inf"))
    with torch.no_grad():
        for _ in range(repeats):
            for fmt, (_, step) in steps.items():
                best[fmt] = min(best[fmt], best_seconds(step, 1))
    rates = {fmt: nbytes / best[fmt] / GB for fmt, (nbytes, _) in steps.items()}
    return {"decode_gbps": rates, "decode_path": path,
            "decode_hidden": config.hidden_size if config is not None else hidden}


def bench_checksum(size_bytes: int = 64 << 20, repeats: int = 5) -> dict:
    """CRC32C bytes/s: every byte the store reads or writes is checksummed on the CPU, on the same
    cores as the compute when there is no GPU."""
    from ..storage.records import checksum

    buf = torch.randint(0, 256, (size_bytes,), dtype=torch.uint8).numpy().tobytes()
    t = best_seconds(lambda: checksum(buf), repeats)
    return {"crc32c_gbps": size_bytes / t / GB}


def machine() -> dict:
    return {"cores": psutil.cpu_count(logical=False) or os.cpu_count(), "logical_cpus": os.cpu_count(),
            "ram_bytes": psutil.virtual_memory().total, "torch": torch.__version__,
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}
