"""How much of the SSD's time the CPU's compute hides when both run at once on the same cores.

The planner's pipeline takes a step to last as long as its busiest resource, with the others hidden
beside it. On a GPU machine that holds: the GPU computes while CPU threads move bytes. Without a GPU
the store's threads (direct reads and writes, CRC32C of every byte, copies) take cycles from the
cores that run the matmuls, so a step where compute and SSD take about as long lasts longer than
either. This probe measures it: a matmul loop alone, the store writing and reading alone, then both
at once, with the matmul loop sized to take as long as the I/O. The overlap is the share of the
shorter one that running them together hid (1: fully hidden, 0: one after the other). It runs
through the engine's own TensorStore, on the drive the runs use, on no model.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..storage import HostBufferPool, TensorStore

BLOCK = 16 << 20  # the size of a large optimizer shard's tensor


def _io_round(store: TensorStore, bufs: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for f in [store.write(f"b{i}", b) for i, b in enumerate(bufs)]:
        f.result()
    for f in [store.read_into(f"b{i}", b, owns_padding=True) for i, b in enumerate(bufs)]:
        f.result()
    return time.perf_counter() - t0


def _compute(n_mm: int, a: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for _ in range(n_mm):
        a @ a
    return time.perf_counter() - t0


def bench_overlap(directory: str | Path, io_bytes: int = 1 << 30, repeats: int = 5) -> dict:
    root = Path(tempfile.mkdtemp(prefix="tierlm-overlap-", dir=directory))
    pool = HostBufferPool(io_bytes + BLOCK, name="overlap probe")
    store = TensorStore(root / "s", pool)
    try:
        bufs = [pool.acquire(BLOCK).view(torch.float32, (BLOCK // 4,)) for _ in range(io_bytes // BLOCK)]
        for b in bufs:
            b.normal_()
        _io_round(store, bufs)  # files allocated: later writes are in place, as a step's are
        a = torch.randn(1024, 1024)
        per_mm = _compute(8, a) / 8
        n_mm = max(1, round(_io_round(store, bufs) / per_mm))
        # Interleaved rounds (alone, alone, together), each judged on its own: the disk's rate
        # drifts by tens of percent from one second to the next here, so minima taken over
        # different moments would not describe one moment.
        rounds = []
        for _ in range(repeats):
            t_io = _io_round(store, bufs)
            t_c = _compute(n_mm, a)
            th = threading.Thread(target=_io_round, args=(store, bufs))
            t0 = time.perf_counter()
            th.start()
            _compute(n_mm, a)
            th.join()
            t_both = time.perf_counter() - t0
            rounds.append((max(0.0, min(1.0, (t_c + t_io - t_both) / min(t_c, t_io))), t_io, t_c, t_both))
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    overlap, t_io, t_c, t_both = sorted(rounds)[len(rounds) // 2]  # the median round
    return {"overlap": overlap, "overlap_rounds": [round(r[0], 3) for r in rounds], "overlap_io_s": t_io,
            "overlap_compute_s": t_c, "overlap_both_s": t_both, "overlap_io_bytes": 2 * io_bytes}
