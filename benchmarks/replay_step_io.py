"""Replay one step's SSD requests from a timeline, with nothing else running and with the compute's
load beside them, alternating: what the drive does with exactly the step's requests, and what it
does while two cores multiply matrices, as they do in the step.

    python benchmarks/replay_step_io.py RUN/timeline.json /path/on/the/nvme --rounds 3
    python benchmarks/replay_step_io.py RUN/timeline.json /path/on/the/nvme --compute-nice 0 --compute-nice 19
    python benchmarks/replay_step_io.py RUN/timeline.json /path/on/the/nvme --small-below 65536 --rounds 6

Each request's file, size and direction are the step's, issued in the order they started with
`--inflight` outstanding, through tierlm's TensorStore (direct I/O, CRC32C on every request). The
files are written once first. The ratio `with compute / alone` is the share of the drive that the
compute costs on this machine; a step cannot be faster than its replay under load.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import wait

import torch

from tierlm.storage import HostBufferPool, TensorStore

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("timeline", help="a timeline.json that `tierlm finetune` or `bench train` wrote")
ap.add_argument("dir", help="scratch directory on the drive to measure (removed afterwards)")
ap.add_argument("--inflight", type=int, default=4)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--compute-threads", type=int, default=2, help="threads of the bf16 matmul run beside")
ap.add_argument("--compute-nice", type=int, action="append", metavar="N",
                help="run the matmul in a separate process at this nice value instead (repeatable: "
                     "each value is a mode of every round); 0 against 19 shows whether the slowdown is "
                     "the drive's or the I/O threads' share of the cores")
ap.add_argument("--small-below", type=int, metavar="BYTES",
                help="instead of the compute's load: the step's requests with and without those under "
                     "BYTES, alternating (what the small requests cost the drive; a timeline recorded "
                     "with packing off, EngineConfig(pack_below=0), has them)")
a = ap.parse_args()

data = json.load(open(a.timeline))
events = data["traceEvents"] if isinstance(data, dict) else data
reqs = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("ssd_read", "ssd_write")),
              key=lambda e: e["ts"])
if not reqs:
    raise SystemExit(f"{a.timeline}: no ssd_read or ssd_write events to replay")
size = {}
for e in reqs:
    size[e["name"]] = max(size.get(e["name"], 0), e["args"]["bytes"])
total = sum(e["args"]["bytes"] for e in reqs)

pool = HostBufferPool(1 << 40, name="replay")
bufs = [pool.acquire(max(size.values())) for _ in range(2 * a.inflight)]
for b in bufs:  # incompressible bytes
    b.tensor.copy_(torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8))
root = os.path.join(a.dir, f".tierlm-replay-{os.getpid()}")
store = TensorStore(root, pool, io_threads=a.inflight)
try:
    wait([store.write(k, bufs[0].tensor[:n]) for k, n in size.items()])
    os.sync()

    def replay(reqs=reqs) -> float:
        t0 = time.perf_counter()
        pending = []
        for i, e in enumerate(reqs):
            if len(pending) >= 2 * a.inflight:
                pending.pop(0).result()
            buf = bufs[i % len(bufs)].tensor[:size[e["name"]]]
            pending.append(store.read_into(e["name"], buf, owns_padding=True) if e["cat"] == "ssd_read"
                           else store.write(e["name"], buf))
        for f in pending:
            f.result()
        return time.perf_counter() - t0

    stop = threading.Event()
    code = (f"import torch; torch.set_num_threads({a.compute_threads}); "
            "x = torch.randn(1024, 1024, dtype=torch.bfloat16)\nwhile True: x @ x")

    def compute():
        torch.set_num_threads(a.compute_threads)
        x = torch.randn(1024, 1024, dtype=torch.bfloat16)
        while not stop.is_set():
            x @ x

    print(f"{len(reqs)} requests, {total / 1e9:.2f} GB, {a.inflight} in flight", flush=True)
    subsets = {"alone": reqs}
    if a.small_below:
        big = [e for e in reqs if e["args"]["bytes"] >= a.small_below]
        subsets["no small"] = big
        print(f"no small: without the {len(reqs) - len(big)} requests under {a.small_below} bytes "
              f"({sum(e['args']['bytes'] for e in reqs) - sum(e['args']['bytes'] for e in big)} bytes)", flush=True)
    modes = ["alone"] + (["no small"] if a.small_below else
                         [f"nice {n}" for n in a.compute_nice] if a.compute_nice else ["compute"])
    best: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    for r in range(a.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            th = proc = None
            if mode == "compute":
                stop.clear()
                th = threading.Thread(target=compute)
                th.start()
                time.sleep(0.3)
            elif mode.startswith("nice "):
                proc = subprocess.Popen(["nice", "-n", mode.split()[1], sys.executable, "-c", code])
                time.sleep(1.0)  # past the import
            s = replay(subsets.get(mode, reqs))
            if th is not None:
                stop.set()
                th.join()
            if proc is not None:
                proc.kill()
                proc.wait()
            best[mode] = min(best.get(mode, s), s)
            times.setdefault(mode, []).append(s)
            print(f"round {r + 1} {mode:8s} {s:6.2f} s  {total / s / 1e9:5.2f} GB/s", flush=True)
    for mode in modes[1:]:
        mean = {m: sum(times[m]) / len(times[m]) for m in (mode, "alone")}
        print(f"{mode} / alone: {best[mode] / best['alone']:.2f} (best of each: {best[mode]:.2f} / "
              f"{best['alone']:.2f} s; means {mean[mode]:.2f} / {mean['alone']:.2f} s)")
finally:
    store.close()
    shutil.rmtree(root, ignore_errors=True)
