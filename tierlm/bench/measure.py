"""The measurements: NVMe sequential bandwidth through tierlm's own store, host memory bandwidth,
matmul throughput per dtype, and the AdamW kernel the optimizer runs.

I/O goes through `TensorStore` (direct I/O where the file system allows it, CRC32C on every tensor,
several requests in flight), so the numbers are what the engine gets, not what `fio` would get.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import psutil
import torch

from ..storage import HostBufferPool, TensorStore
from ..storage.aligned import aligned_empty

GB = 1e9


def _best(fn, repeats: int) -> float:
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
    t = _best(lambda: dst.copy_(src), repeats)
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
        by[name] = n * READ_K / _best(fn, repeats) / GB
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
    t = _best(update, 10)
    return {"matmul_tflops": out, "matmul_n": n, "matmul_n_by_dtype": sizes, "adamw_elems_per_s": k / t,
            "threads": torch.get_num_threads()}


# Decoder layers unrelated to any model benchmarked (llama-style, heads of 64, a quarter as many KV
# heads, SwiGLU 8/3 x hidden), at octave widths and two token counts: a CPU layer's FLOP rate grows with
# its matrices' width and with the rows they multiply (a 256-row product keeps the cores' caches
# busier per FLOP than a 2048-row one), so the planner interpolates in both (log-log) and clamps outside.
# The rate saturates with width (concave in log-log): between 512 and 2048 alone, a 1024-wide layer's
# rate came out ~12% low (genoa-2c, bf16, three probes), hence the middle octave.
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

    Each shape's best of `repeats` rounds, the rounds interleaved across shapes: on genoa-2c a
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
            best[i] = min(best[i], _best(step, 1))
    table: dict[str, dict[str, float]] = {str(t): {} for t in tokens}
    for (hidden, count, flops, _), t in zip(shapes, best):
        table[str(count)][str(hidden)] = flops / t / 1e12
    top = str(max(tokens))
    return {"layer_tflops": table[top], "layer_tokens": max(tokens), "layer_tflops_by_tokens": table,
            "layer_dtype": "bf16" if dtype == torch.bfloat16 else "fp32"}


MODEL_STEP_S = 4.0        # one layer's timed step at most about this (fewer rows of the run's length)
MODEL_MAX_PARAMS = 2e9    # beyond: building the probe model takes longer than the plan is worth
# More rounds than `repeats` while they take less than MODEL_PROBE_S: on a 2-core machine shared
# with other work (load 6-7), one llama layer's forward + backward at 512 tokens took 0.18-2.1 s in
# ten rounds, and the run's own layers 0.09-0.13 s: the best of five can miss the quiet moments.
MODEL_PROBE_S = 10.0
MODEL_MAX_ROUNDS = 25


def model_step_key(config, tokens: int, seq: int, dtype: torch.dtype) -> str:
    """What a model-step probe depends on: the family, the shapes, the micro-batch, dtype and threads."""
    d = config.to_dict()
    shape = {k: d.get(k) for k in ("model_type", "hidden_size", "n_embd", "intermediate_size", "n_inner",
                                    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                    "hidden_act", "tie_word_embeddings", "sliding_window")}
    return (json.dumps(shape, sort_keys=True) + f"|tokens={tokens}|seq={seq}|{str(dtype).removeprefix('torch.')}"
            f"|threads={torch.get_num_threads()}")


def bench_model_step(config, tokens: int, seq: int, dtype: torch.dtype, repeats: int = 5) -> dict | None:
    """Seconds of a training micro-batch through the model's own code, split into one decoder
    layer's forward + backward and the rest (embedding, final norm, head and loss), on torch's
    threads (the run's), in the run's compute dtype and sequence length: what `finetune` computes,
    not a generic layer at a reference width.

    The model family's code is built from `config` by transformers (as the engine builds it), with
    one decoder layer. A whole step (the engine's path: head and loss in chunks where the engine
    chunks them, head_loss) is timed, and its layer alone, called again with the arguments the
    model's own forward gave it (captured by a hook: any family's signature); the rest is the
    difference. Timing the layer directly, not as the difference of two depths, keeps the noise
    of a shared machine out of the number the plan multiplies by the layer count (two depths, 3
    rounds, on a 2-core machine shared with other work, once put a layer at 6x what the run's own
    layers took).

    At the run's rows per micro-batch where one layer's step takes at most MODEL_STEP_S and the
    step fits a quarter of the free memory; else fewer rows of the run's length, scaled per token
    (the attention's cost per token depends on the length, kept). None where even one row does
    not fit, or the model is too large to build quickly: the planner then interpolates between
    bench compute's reference layers and says so.

    Each part's best of `repeats` rounds or more (MODEL_PROBE_S), interleaved. The steps run as the engine's do: with freed
    blocks kept in the heap for reuse (HeapGuard); under tierlm's import settings every transient
    tensor would be fresh pages zeroed by the kernel, a cost the step it predicts does not pay."""
    import copy

    from transformers import AutoModelForCausalLM

    from ..engine import budget as B
    from ..engine.head_loss import causal_lm_loss, chunk_tokens
    from ..engine.heap import MIN_COMPUTE_SHARE, HeapGuard
    from ..engine.model import find_layers

    rows_want = max(1, tokens // seq)
    per_row = B.layer_activation_bytes(config, seq, dtype) + B.logits_bytes(config, seq, dtype)
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    elem = torch.empty((), dtype=dtype).element_size()
    room = psutil.virtual_memory().available // 4 - n * (4 + 2 * elem)  # the fp32 init, weights, gradients
    if n > MODEL_MAX_PARAMS or room < per_row:
        return None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.train()
    layer = find_layers(model)[1][0]
    head = model.get_output_embeddings()
    plain_head = type(head) is torch.nn.Linear and not getattr(config, "final_logit_softcapping", None)

    def model_step(rows):
        ids = torch.randint(0, config.vocab_size, (rows, seq))
        chunk = chunk_tokens(rows * seq, config.vocab_size, dtype) if plain_head else None

        def step():
            model.zero_grad(set_to_none=True)
            if chunk:
                hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
                loss = causal_lm_loss(hidden, head, ids, chunk)
            else:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        return step

    def layer_step(whole):
        """The layer's own forward + backward, on the arguments the model's forward passed it."""
        got = {}

        def hook(mod, args, kwargs):
            got["args"], got["kwargs"] = args, kwargs
        h = layer.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            whole()
        finally:
            h.remove()
        args, kwargs = list(got["args"]), dict(got["kwargs"])
        if args:
            x = args[0].detach().clone().requires_grad_(True)
            args[0] = x
        else:
            x = kwargs["hidden_states"].detach().clone().requires_grad_(True)
            kwargs["hidden_states"] = x
        kwargs = {k: (v.detach() if isinstance(v, torch.Tensor) else
                      tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in v) if isinstance(v, tuple) else v)
                  for k, v in kwargs.items()}

        def step():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            y = layer(*args, **kwargs)
            (y[0] if isinstance(y, tuple) else y).float().sum().backward()
        return step

    guard = HeapGuard(1 << 50, MIN_COMPUTE_SHARE)
    try:
        one = layer_step(model_step(1))
        one()  # first-call allocations and kernel selection: not what a row costs
        t_row = _best(one, 3)
        rows = max(1, min(rows_want, int(room // per_row), int(MODEL_STEP_S / max(t_row, 1e-6))))
        whole = model_step(rows)
        steps = {"model": whole, "layer": layer_step(whole)}
        for st in steps.values():
            st()  # warm-up at the timed shape
        best = dict.fromkeys(steps, float("inf"))
        t0, rounds = time.perf_counter(), 0
        while rounds < repeats or (time.perf_counter() - t0 < MODEL_PROBE_S and rounds < MODEL_MAX_ROUNDS):
            for k, st in steps.items():
                best[k] = min(best[k], _best(st, 1))
            rounds += 1
    finally:
        guard.close()
    probed = rows * seq
    scale = tokens / probed  # the run's tokens per micro-batch
    return {"layer_s": best["layer"] * scale, "rest_s": max(best["model"] - best["layer"], 0.0) * scale,
            "tokens": tokens, "probed_tokens": probed, "seq": seq, "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "model_s": best["model"] * scale, "model_type": config.model_type}


ENGINE_PROBE_LAYERS = 2   # the probe model's depth: one layer beside the head, one beside the embedding
# The first steps pay for first reads, kernel selection and the heap and caches filling: on a 2-core
# machine a two-layer probe's steps 2-4 still took 1.2-1.6x the steady ones (as a run's steps 2-3
# do), so the median is of the steps after ENGINE_PROBE_WARMUP.
ENGINE_PROBE_STEPS = 8
ENGINE_PROBE_WARMUP = 3


def engine_step_key(config, tokens: int, seq: int, dtype: torch.dtype, cpu_mem: int | None, clip: str,
                    state_cache: bool = True) -> str:
    """What an engine-step probe depends on: the model-step key's, the budget, clipping and state
    cache, and the steps it times (a probe cached with fewer warm-up steps is measured again)."""
    return (f"engine|{model_step_key(config, tokens, seq, dtype)}|cpu_mem={cpu_mem}|clip={clip}"
            f"|state_cache={state_cache}|steps={ENGINE_PROBE_STEPS}-{ENGINE_PROBE_WARMUP}")


def bench_engine_step(config, tokens: int, seq: int, dtype: torch.dtype, directory: str | os.PathLike,
                      cpu_mem: int | None = None, clip: str = "on", state_cache: bool = True,
                      layers: int = ENGINE_PROBE_LAYERS, steps: int = ENGINE_PROBE_STEPS,
                      warmup: int = ENGINE_PROBE_WARMUP) -> dict | None:
    """Seconds of a training step as `tierlm finetune` runs it, from a copy of the model's family
    and shapes with `layers` decoder layers (random weights) driven by the engine itself, at the
    run's micro-batch, sequence length, dtype, threads and budget: split into one decoder layer's
    compute and the rest of the step.

    Why the engine and not the bare layer: in a run the layer's forward and backward share the
    cores with the optimizer updating the layer before it, the store's checksums and writes, the
    gradient hooks and weight installs; on a 2-core machine the engine's own per-layer profile came
    out 1.5-2x a bare layer's forward + backward at the same shapes. Here those costs are in the
    number, measured where they happen.

    The step is timed as finetune times it (from the end of one step to the end of the next, the
    deferred commit's writes landing in the next step; the activation planner's one-off drive probe
    left out). The per-layer time is the engine's own profile of the first layer (forward +
    backward, waits excluded; it runs beside the next layer's update, as every layer but the last
    does in a deeper model); the rest (embedding, head and loss, the last layer's extra beside the
    head's update, commit, waits) is the step less `layers` of it. Medians over the steps after the
    first `warmup`; `read_bytes`, what a step read from the drive (state the budget did not cache): the CPU
    work of those reads is in the step, the planner adds only the reads a deeper model makes beyond.
    None where the probe model is too large to build quickly."""
    import copy
    import gc
    import statistics
    import tempfile

    from transformers import AutoModelForCausalLM

    from ..engine.engine import Engine, EngineConfig
    from ..engine.optim_types import AdamWConfig

    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if n > MODEL_MAX_PARAMS:
        return None
    rows = max(1, tokens // seq)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    # clipping on (or redo): the gradients are saved for the exact redo, as in the run; the limit is
    # out of reach so that random weights' large norms do not redo every step (the planner adds the
    # redo where the task clips every step)
    optim = AdamWConfig(max_grad_norm=None if clip == "off" else 1e30)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    root = Path(tempfile.mkdtemp(prefix=".tierlm-engine-probe-", dir=directory))
    ecfg = EngineConfig(nvme_dir=str(root / "nvme"), cpu_mem=cpu_mem if cpu_mem else "4GiB", precision=precision,
                        activations="keep", optim=optim, state_cache=state_cache, tokens_per_micro_batch=rows * seq,
                        micro_batch_size=rows)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (rows, seq), generator=g) for _ in range(steps + 1)]
    step_s, layer_s, read = [], [], []
    eng = None
    try:
        eng = Engine.from_model(model, ecfg)  # a budget it refuses raises: the caller falls back
        del model
        gc.collect()
        gc.freeze()  # as finetune: a full collection walking the run held the GIL from the I/O threads
        t0, r0 = time.perf_counter(), eng.store.stats.snapshot()["bytes_read"]
        for i in range(steps):
            loss = eng.forward(batches[i], labels=batches[i]).loss
            eng.expect(batches[i + 1])
            eng.backward(loss)
            eng.finish()
            now = time.perf_counter()
            first = eng.acts.cur[min(eng.acts.cur)]
            step_s.append(now - t0)
            layer_s.append(first["fwd"] + first["bwd"])
            r1 = eng.store.stats.snapshot()["bytes_read"]
            read.append(r1 - r0)
            t0, r0 = now, r1
            probed = eng.acts.measure_s
            eng.commit()
            t0 += eng.acts.measure_s - probed
    finally:
        gc.unfreeze()
        if eng is not None:
            eng.close()
        shutil.rmtree(root, ignore_errors=True)
    step, layer = statistics.median(step_s[warmup:]), statistics.median(layer_s[warmup:])
    return {"layer_s": layer, "rest_s": max(step - layers * layer, 0.0), "step_s": step, "layers": layers,
            "tokens": tokens, "probed_tokens": rows * seq, "seq": seq, "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "model_type": config.model_type, "source": "engine",
            "steps": len(step_s) - warmup, "read_bytes": int(statistics.median(read[warmup:]))}


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
    one format's rounds back to back took a tenth of a second, and on genoa-2c the memory rate
    switches between states for seconds at a time (bf16 once probed at 21 GB/s beside int8 at 28,
    35 a run before). A probe still lands in one state: three in a row read 29.6, 36.5, 29.2 GB/s."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from ..infer.kvcache import SlotKVCache
    from ..infer.lean import LeanDecoder
    from ..infer.quant import QLinear, replace_linears

    inter = hidden * 8 // 3 // 64 * 64
    steps, path = {}, None  # format -> (weight bytes, one decode step)
    for fmt in formats:
        if config is not None:
            # a model's own layers (`tierlm plan --task serve --hardware this`): its family's code
            # and shapes; a small vocabulary, since the head is not what is timed here
            from transformers import AutoModelForCausalLM
            cfg = copy.deepcopy(config)
            cfg.num_hidden_layers, cfg.vocab_size, cfg.max_position_embeddings = 1, 256, 64
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
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
        model.config.num_hidden_layers = n
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
                best[fmt] = min(best[fmt], _best(step, 1))
    rates = {fmt: nbytes / best[fmt] / GB for fmt, (nbytes, _) in steps.items()}
    return {"decode_gbps": rates, "decode_path": path,
            "decode_hidden": config.hidden_size if config is not None else hidden}


def bench_checksum(size_bytes: int = 64 << 20, repeats: int = 5) -> dict:
    """CRC32C bytes/s: every byte the store reads or writes is checksummed on the CPU, on the same
    cores as the compute when there is no GPU."""
    from ..storage.records import checksum

    buf = torch.randint(0, 256, (size_bytes,), dtype=torch.uint8).numpy().tobytes()
    t = _best(lambda: checksum(buf), repeats)
    return {"crc32c_gbps": size_bytes / t / GB}


def machine() -> dict:
    return {"cores": psutil.cpu_count(logical=False) or os.cpu_count(), "logical_cpus": os.cpu_count(),
            "ram_bytes": psutil.virtual_memory().total, "torch": torch.__version__,
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}
