"""Rooflines for the phase report: this machine's measured memory, SSD and matmul rates.

Measured once in a child process (so its buffers never count against this process's budget) and
kept in a small JSON file. A phase's time is compared with what each resource alone would need
for the bytes and FLOPs it moved: the largest share is the bound it is closest to.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..units import count

_PROBE = r"""
import json, os, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))  # the threads decode ran on
out = {}
# memory: read the way decode reads its weights (our one-row kernels over a huge-page buffer on
# decode's threads, best of several rounds and of the ways tried): bench.measure.bench_read
from tierlm.bench.measure import bench_read
r = bench_read()
out["mem_gbps"], out["mem_how"], out["mem_gbps_by_way"] = r["read_gbps"], r["read_how"], r["read_gbps_by_way"]
for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    a = torch.randn(512, 2048, dtype=dt); b = torch.randn(2048, 2048, dtype=dt)
    a @ b; dt = 1e9
    for _ in range(4):
        t = time.perf_counter(); a @ b; dt = min(dt, time.perf_counter() - t)
    out[f"matmul_{name}_gflops"] = 2 * 512 * 2048 * 2048 / dt / 1e9
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


def machine_rates(nvme_dir: str | None = None, cache: str | None = None, fresh: bool = False,
                  store: dict | None = None) -> dict:
    """{'mem_gbps', 'matmul_bf16_gflops', 'matmul_fp32_gflops', 'ssd_gbps'?}; cached per directory
    (`fresh` measures again and replaces the cached entry: benchmarks compare within one run;
    `store` replaces it with these rates, measuring nothing)."""
    cache_path = Path(cache or Path(os.environ.get("TIERLM_CACHE_DIR") or Path.home() / ".cache" / "tierlm")
                      / "rates.json")
    # per machine and per file system (the SSD rate is the directory's device's); RATES_VERSION
    # changes when a probe changes, so a rate an older probe cached is measured again
    where = Path(nvme_dir or ".").resolve()
    while not where.exists():
        where = where.parent
    import torch
    threads = torch.get_num_threads()
    key = f"{RATES_VERSION}:{os.cpu_count()}:{threads}:{where.stat().st_dev if nvme_dir else ''}"
    try:
        known = json.loads(cache_path.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}

    def save(rates: dict) -> dict:
        known[key] = rates
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            cache_path.write_text(json.dumps(known, indent=1))
        except OSError:  # an unwritable cache costs a later probe, not this report
            pass
        return rates

    if store is not None:
        return save(store)
    if key in known and not fresh:
        return known[key]
    print(f"tierlm: measuring this machine's rates for the report's rooflines (memory read as decode reads, on "
          f"{count(threads, 'thread')}; matmul" + (f"; the drive under {nvme_dir}, at most 128 MiB" if nvme_dir else "")
          + f"): about 10 s, once (cached in {cache_path})", file=sys.stderr, flush=True)
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, nvme_dir or "", str(threads)], capture_output=True,
                           text=True, timeout=300)
        rates = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        rates = None
    if rates is None:  # the report goes without rooflines; the generation it reports on is done
        return {}
    return save(rates)


def phase_line(name: str, seconds: float, tokens: int, ram: int, ssd: int, kv: int, flops: float,
               rates: dict, dtype: str) -> tuple[str, dict]:
    """One line: tokens/s, effective GB/s, and the share of each roofline the phase reached."""
    if seconds <= 0 or tokens == 0:
        return f"{name}: nothing ran", {}
    gbps = (ram + kv + ssd) / seconds / 1e9
    shares = {}
    if rates.get("mem_gbps"):
        shares["memory"] = (ram + kv) / (rates["mem_gbps"] * 1e9) / seconds
    if ssd and rates.get("ssd_gbps"):
        shares["ssd"] = ssd / (rates["ssd_gbps"] * 1e9) / seconds
    mm = rates.get(f"matmul_{'bf16' if dtype == 'bf16' else 'fp32'}_gflops")
    if mm:
        shares["compute"] = flops / (mm * 1e9) / seconds
    bound = max(shares, key=shares.get) if shares else "unknown"
    parts = ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items())
    line = (f"{name}: {count(tokens, 'token')} in {seconds:.3f} s = {tokens / seconds:.1f} tok/s, "
            f"{gbps:.2f} GB/s effective (weights from RAM {ram / seconds / 1e9:.2f}, SSD {ssd / seconds / 1e9:.2f}, "
            f"KV {kv / seconds / 1e9:.2f}); closest bound: {bound} (share of each roofline: {parts})")
    return line, {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "gbps": gbps,
                  "bound": bound, "shares": shares}


def compute_dtype(engine) -> str:
    """The dtype the products compute in: a bf16 model's products run in fp32 where this CPU's bf16
    matmul is slow (gemv.py upcasts many rows; our kernels widen the weights to fp32), so its
    compute roofline is the fp32 matmul rate (against the bf16 one, 0.3 GFLOP/s on an AVX2-only
    EPYC, a decode phase read as 89x its compute roofline)."""
    import torch

    from .gemv import bf16_matmul_is_slow
    return "bf16" if engine.dtype == torch.bfloat16 and not bf16_matmul_is_slow() else "fp32"


def report(batcher, engine, requests, rates: dict) -> tuple[list[str], dict]:
    """Lines for `tierlm generate`: TTFT, prefill and decode phases.

    A phase that read memory faster than the cached roofline proves the roofline low (measured in
    a busier moment of a shared machine: one cached at 30.8 GB/s, decode then read 31-32): the
    memory is measured again, once, and the roofline is the faster of the two, kept in the cache."""
    lines, out = _report(batcher, engine, requests, rates)
    if any(d.get("shares", {}).get("memory", 0) > 1 for d in out.values() if isinstance(d, dict)) \
            and not rates.get("remeasured"):
        print("tierlm: a phase read memory faster than the measured roofline; measuring it again", file=sys.stderr)
        nvme = str(engine.store.root) if getattr(engine, "store", None) else None
        new = machine_rates(nvme, fresh=True)
        if new.get("mem_gbps"):
            best = max(new["mem_gbps"], rates.get("mem_gbps") or 0.0)
            rates.update(new)
            rates["mem_gbps"], rates["remeasured"] = best, True
            machine_rates(nvme, store={**rates})
            lines, out = _report(batcher, engine, requests, rates)
    return lines, out


def _report(batcher, engine, requests, rates: dict) -> tuple[list[str], dict]:
    s = batcher.stats
    lines, out = [], {}
    ttfts = [r.t_first - r.t_submit for r in requests if r.t_first]
    if ttfts:
        out["ttft_s"] = sum(ttfts) / len(ttfts)
        lines.append(f"time to first token: {out['ttft_s']:.3f} s (mean of {len(ttfts)})")
    for ph in ("prefill", "decode"):
        flops = 2 * engine.flop_params * s.tokens[ph]
        line, d = phase_line(ph, s.s[ph], s.tokens[ph], s.ram[ph], s.ssd[ph], s.kv[ph], flops, rates,
                             compute_dtype(engine))
        lines.append(line)
        out[ph] = d
    return lines, out
