"""CPU seconds this process spends, by component, from the kernel's per-thread counters.

On a machine of few cores the engine's own work (the optimizer, the store's copies and checksums,
commits) runs on the cores the layers compute on, and a step's wall time cannot show which of it
takes them. Each of tierlm's threads has a name (`tierlm-optim`, `tierlm-read`, ...); torch's
compute pool has none; the main thread runs the layers' Python and its share of their products.
Reading the counters is one /proc walk, cheap enough to do once a step; the kernel counts in
clock ticks (10 ms), so a component of a very short step may read 0.
"""
from __future__ import annotations

import threading

import psutil

# thread-name prefix -> component (a pool's threads are named prefix_N)
NAMED = {"tierlm-optim": "optimizer", "tierlm-read": "io", "tierlm-write": "io", "tierlm-crc": "checksums",
         "tierlm-commit": "commit", "tierlm-grad-reduce": "grad_reduce"}
MAIN = "main"            # the layers' Python and the main thread's share of their products
POOL = "torch_threads"   # threads Python does not know: torch's intra-op (OpenMP) compute pool
OTHER = "other"          # Python threads of no component (a progress bar's monitor, say)
EXITED = "exited"        # CPU time of threads that ended since the last reading


def component(thread_name: str) -> str:
    for prefix, comp in NAMED.items():
        if thread_name.startswith(prefix):
            return comp
    return OTHER


class CpuClock:
    """lap(): CPU seconds by component since the last lap (or since the clock was made)."""

    def __init__(self):
        self._proc = psutil.Process()
        self._names: dict[int, str] = {}  # native id -> name of every Python thread seen
        self._last = self._read()

    def _read(self) -> dict[str, float]:
        # a thread Python has finished (joined) can still be listed by the kernel for a moment:
        # the name it had keeps its time in its component, not torch's pool
        self._names.update({t.native_id: t.name for t in threading.enumerate()})
        names = self._names
        main = threading.main_thread().native_id
        out: dict[str, float] = {}
        for th in self._proc.threads():
            comp = MAIN if th.id == main else component(names[th.id]) if th.id in names else POOL
            out[comp] = out.get(comp, 0.0) + th.user_time + th.system_time
        t = self._proc.cpu_times()  # this process alone: child processes are not counted
        out["_total"] = t.user + t.system
        return out

    def lap(self) -> dict[str, float]:
        now, prev = self._read(), self._last
        self._last = now
        spent = {k: max(0.0, v - prev.get(k, 0.0)) for k, v in now.items() if k != "_total"}
        gone = (now["_total"] - prev["_total"]) - sum(spent.values())
        if gone > 0.01:  # a thread that ended took its counters with it; the process kept the sum
            spent[EXITED] = gone
        return {k: round(v, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v > 0}


def describe(spent: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in spent.items())
