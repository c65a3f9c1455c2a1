"""This machine's rooflines for the generation report: its measured memory, SSD and matmul rates.

Measured once in a child process (so its buffers never count against the caller's budget) and kept
in the one cache of measured rates (tierlm.bench.cache: $TIERLM_CACHE_DIR/bench.json), section
"rooflines", one entry per machine, compute threads and file system. `tierlm generate` reads them
(tierlm.serve) and hands them to its report as data.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..units import count
from . import cache

SECTION = "rooflines"

_PROBE = r"""
import json, os, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))  # the threads decode ran on
out = {}
# memory: read the way decode reads its weights (our one-row kernels over a huge-page buffer on
# decode's threads, best of several rounds and of the ways tried): bench.measure.bench_read
from tierlm.bench.measure import bench_read
r = bench_read()
out["mem_gbps"], out["mem_how"], out["mem_gbps_by_way"] = r["read_gbps"], r["read_how"], r["read_gbps_by_way"]
# rows grown from 8 until a product takes 0.05 s (at most 512): a CPU without bf16 instructions
# multiplies bf16 at ~0.3 GFLOPS, where 512 rows took 15 s a product (77 s for this probe)
for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    a = torch.randn(512, 2048, dtype=dt); b = torch.randn(2048, 2048, dtype=dt)
    rows = 8
    while True:
        x = a[:rows].contiguous(); x @ b  # (the first call of a shape sets up)
        t = time.perf_counter(); x @ b; took = time.perf_counter() - t
        if took >= 0.05 or rows >= 512:
            break
        rows *= 4
    dt = took
    for _ in range(3):
        t = time.perf_counter(); x @ b; dt = min(dt, time.perf_counter() - t)
    out[f"matmul_{name}_gflops"] = 2 * rows * 2048 * 2048 / dt / 1e9
d = sys.argv[1]
if d:
    from tierlm.storage.aligned import aligned_empty, supports_direct_io
    os.makedirs(d, exist_ok=True)
    from tierlm.bench.measure import probe_size
    path = os.path.join(d, "probe.bin"); n = probe_size(d, 128 << 20)[0]  # at most 1/8 of the free space
if d and n:
    buf = aligned_empty(n)
    buf.fill_(7)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); os.write(fd, buf.numpy()); os.fsync(fd); os.close(fd)
    direct = supports_direct_io(d)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    mv = memoryview(buf.numpy()); t = time.perf_counter(); got = 0
    for _ in range(2):
        got += os.preadv(fd, [mv], 0)
    out["ssd_gbps"] = got / (time.perf_counter() - t) / 1e9
    out["ssd_direct_io"] = direct
    os.close(fd); os.unlink(path)
print(json.dumps(out))
"""



# 2: the memory rate read as decode reads (bench.measure.bench_read); 1 (no prefix): a torch sum
RATES_VERSION = 2


def rates_key(nvme_dir: str | None, threads: int) -> str:
    """Per machine and per file system (the SSD rate is the directory's device's); RATES_VERSION
    changes when a probe changes, so a rate an older probe cached is measured again."""
    where = Path(nvme_dir or ".").resolve()
    while not where.exists():
        where = where.parent
    return f"{RATES_VERSION}:{os.cpu_count()}:{threads}:{where.stat().st_dev if nvme_dir else ''}"


def _cached() -> dict:
    try:
        return dict(cache.load().get(SECTION) or {})
    except ValueError:  # an unreadable cache costs a probe, not the report
        return {}


def _save(key: str, rates: dict) -> dict:
    try:
        cache.update(SECTION, {**_cached(), key: rates})
    except (OSError, ValueError):  # an unwritable cache costs a later probe, not this report
        pass
    return rates


def machine_rates(nvme_dir: str | None = None, fresh: bool = False, store: dict | None = None) -> dict:
    """{'mem_gbps', 'matmul_bf16_gflops', 'matmul_fp32_gflops', 'ssd_gbps'?}, cached (`fresh`
    measures again and replaces the cached entry: benchmarks compare within one run; `store`
    replaces it with these rates, measuring nothing). {} where the probe fails."""
    import torch
    threads = torch.get_num_threads()
    key = rates_key(nvme_dir, threads)
    if store is not None:
        return _save(key, store)
    known = _cached()
    if key in known and not fresh:
        return known[key]
    print(f"tierlm: measuring this machine's rates for the report's rooflines (memory read as decode reads, on "
          f"{count(threads, 'thread')}; matmul" + (f"; the drive under {nvme_dir}, at most 128 MiB" if nvme_dir else "")
          + f"): about 10 s, once (cached in {cache.cache_path()})", file=sys.stderr, flush=True)
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, nvme_dir or "", str(threads)], capture_output=True,
                           text=True, timeout=300)
        rates = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        rates = None
    if rates is None:  # the report goes without rooflines; the generation it reports on is done
        return {}
    return _save(key, rates)
