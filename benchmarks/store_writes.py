"""The store's writes: overwritten in place against written to a new file and renamed, side by side.

    python benchmarks/store_writes.py --dir /mnt/nvme/bench --sizes 1 4 16 --total 1GiB

For each tensor size, the same bytes are written `--rounds` times over the same keys (as a
training step rewrites its optimizer slot every other step) through `TensorStore` with `in_place`
on and off, alternating, each round after a `sync`; reads of the same keys are timed too. Prints
GB/s per mode and the ratio.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch

from tierlm.storage import HostBufferPool, TensorStore
from tierlm.storage.aligned import aligned_empty
from tierlm.units import parse_bytes


def rewrite(store: TensorStore, bufs: list[torch.Tensor], n: int) -> float:
    os.sync()
    t0 = time.perf_counter()
    futs = [store.write(f"t{i}", bufs[i % len(bufs)]) for i in range(n)]
    for f in futs:
        f.result()
    return time.perf_counter() - t0


def read_back(store: TensorStore, bufs: list[torch.Tensor], n: int) -> float:
    t0 = time.perf_counter()
    futs = [store.read_into(f"t{i}", bufs[i % len(bufs)], owns_padding=True) for i in range(n)]
    for f in futs:
        f.result()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/tierlm-store-bench")
    ap.add_argument("--sizes", nargs="*", type=float, default=[1, 4, 16], help="MiB per tensor")
    ap.add_argument("--total", default="1GiB", help="bytes written per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    a = ap.parse_args()
    total = parse_bytes(a.total)
    print(f"load average before: {os.getloadavg()}")
    rows = []
    for mib in a.sizes:
        size = int(mib * (1 << 20))
        n = max(4, total // size)
        bufs = [aligned_empty(size).view(torch.uint8)[:size] for _ in range(8)]
        for b in bufs:
            b.random_(0, 256)
        times = {True: [], False: [], "read": []}
        stores = {}
        for mode in (True, False):
            root = Path(a.dir) / f"{mib}-{mode}"
            shutil.rmtree(root, ignore_errors=True)
            stores[mode] = TensorStore(root, HostBufferPool(0, name="bench"), io_threads=a.threads, in_place=mode)
            rewrite(stores[mode], bufs, n)  # the files exist from here on, as after a run's first step
        for _ in range(a.rounds):
            for mode in (True, False):
                times[mode].append(rewrite(stores[mode], bufs, n))
            times["read"].append(read_back(stores[True], bufs, n))
        for st in stores.values():
            st.close()
        gb = n * size / 1e9
        best = {k: gb / min(v) for k, v in times.items()}
        rows.append((mib, n, best))
        print(f"{mib:g} MiB x {n}: write in place {best[True]:.2f} GB/s, new file + rename {best[False]:.2f} GB/s "
              f"(ratio {best[True] / best[False]:.2f}x); read {best['read']:.2f} GB/s", flush=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    print("\n| MiB per tensor | tensors | write in place GB/s | new file + rename GB/s | ratio | read GB/s |")
    print("|---|---|---|---|---|---|")
    for mib, n, b in rows:
        print(f"| {mib:g} | {n} | {b[True]:.2f} | {b[False]:.2f} | {b[True] / b[False]:.2f}x | {b['read']:.2f} |")


if __name__ == "__main__":
    main()
