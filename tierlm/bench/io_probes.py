"""Drive probes: sequential bandwidth through tierlm's own store, and the requests in flight and
request size the engine should use.

I/O goes through `TensorStore` (direct I/O where the file system allows it, CRC32C on every tensor,
several requests in flight), so the numbers are what the engine gets, not what `fio` would get.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from ..storage import HostBufferPool, TensorStore
from ..storage.aligned import aligned_empty
from .cache import mount_point
from .timing import GB


def _pipelined(n: int, inflight: int, request) -> None:
    """request(i, slot) for each i < n, at most `inflight` outstanding: slot i % inflight's previous
    request is waited for first, and every one before this returns."""
    pending = [None] * inflight
    for i in range(n):
        slot = i % inflight
        if pending[slot] is not None:
            pending[slot].result()
        pending[slot] = request(i, slot)
    for f in pending:
        if f is not None:
            f.result()


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
        _pipelined(n, inflight, lambda i, slot: store.write(f"b{i}", bufs[slot][:block_bytes]))
        os.sync()  # buffered writes (no direct I/O) count only once on the device
        return time.perf_counter() - t0

    try:
        create_s = write_all()
        write_s = write_all()
        t0 = time.perf_counter()
        _pipelined(n, inflight, lambda i, slot: store.read_into(f"b{i}", bufs[slot][:block_bytes], owns_padding=True))
        read_s = time.perf_counter() - t0
        direct = store.direct
    finally:
        store.close()
        shutil.rmtree(work, ignore_errors=True)
    total = n * block_bytes
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
    read as fast as eight, at 256 KiB 35-40% slower (docs/benchmarks.md at a2b1c1e), and about a third of a
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

