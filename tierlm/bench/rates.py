"""What `tierlm bench` measured of this machine, read for a run and handed down as data
(`tierlm.plan.settings.Measured`): nothing below the recipes reads the cache."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ..plan import activations as P
from ..plan.settings import Measured
from . import cache
from .measure import GB, probe_size


def measured(root: str | Path, probe: bool = True) -> Measured:
    """The cached `bench io` of the file system `root` is on and `bench compute`, and the activation
    planner's drive and memory rates: cached (by `bench io`, else by an earlier run's probe), else
    (probe) measured when the planner first asks."""
    io = cache.io_for(root)
    try:
        compute = cache.load().get("compute")
    except ValueError:  # an unreadable cache: the run goes on with the defaults
        compute = None
    rates = _cached_rates(root, io)
    return Measured(io=io, compute=compute, activation_rates=rates,
                    probe=(lambda: activation_rates(Path(root))) if probe and rates is None else None)


PROBE_BYTES = 256 << 20


def _cached_rates(root, io: dict | None) -> P.Rates | None:
    """The planner's rates from `bench io` of root's file system, else from the probe an earlier
    run made of it (a brief one; `bench io` measures longer); None where neither is cached. The
    rates choose where activations go and how often state is committed, which change no bit."""
    if io and io.get("read_gbps") and io.get("mem_gbps"):
        return P.Rates(io["read_gbps"] * GB, io["write_gbps"] * GB, io["mem_gbps"] * GB / 2,
                       "tierlm bench io (cached)")
    kept = cache.probe_for(root)
    try:
        return P.Rates(kept["read_gbps"] * GB, kept["write_gbps"] * GB, kept["mem_gbps"] * GB / 2,
                       f"an earlier run's drive probe ({kept.get('when', '?')}, cached; "
                       f"`tierlm bench io --nvme DIR` measures longer)")
    except (TypeError, KeyError):
        return None


def _say(msg: str) -> None:
    print(f"tierlm: {msg}", file=sys.stderr, flush=True)


def _default_rates(why: str, say=_say) -> P.Rates:
    rates = P.default_rates(why)
    say(f"activation planner: {why}; planning with default rates ({P.describe(rates)}); "
        f"`tierlm bench io --nvme DIR` measures them")
    return rates


def activation_rates(root: Path, say=_say) -> P.Rates:
    """SSD and memory rates from `tierlm bench io`'s cache; when there are none (or they are of
    another file system), measured briefly in a child process, whose buffers are not this run's.

    A measurement must never stop the run it is for: the probe writes at most 1/8 of the free space
    (bench.measure.probe_size), is skipped where that is too little to measure, and any failure of
    it (a full drive, a child killed, unreadable output) leaves the run on printed default rates."""
    try:
        io = cache.io_for(root) or {}
    except Exception:  # an unreadable cache is `bench io`'s to report, not this run's
        io = {}
    rates = _cached_rates(root, io)
    if rates is not None:
        return rates
    try:
        size, why = probe_size(root, PROBE_BYTES)
    except OSError as e:
        return _default_rates(f"cannot see the free space under {root} ({e})", say)
    if not size:
        return _default_rates(f"drive probe skipped: {why}", say)
    say(f"activation planner: measuring the drive under {root} (writes and reads {why}) and the memory "
        f"copy rate, once for this run: a few seconds ...")
    code = ("import json, sys; from tierlm.bench.measure import bench_io, bench_memory\n"
            "r = bench_io(sys.argv[1], size_bytes=int(sys.argv[2])); r.update(bench_memory(64 << 20, 3))\n"
            "print(json.dumps(r))")
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", code, str(root), str(size)], capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
            raise RuntimeError(last)
        io = json.loads(out.stdout.strip().splitlines()[-1])
        rates = P.Rates(io["read_gbps"] * GB, io["write_gbps"] * GB, io["mem_gbps"] * GB / 2,
                        f"measured at the first step ({why}, a child process)")
        cache.keep_probe(root, {k: io[k] for k in ("read_gbps", "write_gbps", "mem_gbps")}
                         | {"size": why, "when": time.strftime("%Y-%m-%d %H:%M")})
    except Exception as e:  # noqa: BLE001 - whatever went wrong, the run goes on
        return _default_rates(f"the drive probe failed ({type(e).__name__}: {e})", say)
    say(f"activation planner: drive read {io['read_gbps']:.2f} GB/s, write {io['write_gbps']:.2f} GB/s, "
        f"memory copy {io['mem_gbps']:.1f} GB/s ({time.perf_counter() - t0:.1f} s)")
    return rates
