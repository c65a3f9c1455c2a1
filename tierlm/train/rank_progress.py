"""Ranks other than 0 print nothing; each still records its own per-step metrics (its own SSD
traffic: the per-rank numbers of docs/benchmarks.md) in metrics-rank<r>.jsonl."""
from __future__ import annotations

import time

from ..bench.cpu_time import CpuClock
from .progress import Progress


class _Silent:
    def write(self, *a, **k):
        pass

    def update(self, *a, **k):
        pass

    def close(self):
        pass


class RankProgress(Progress):
    def __init__(self, total, start, engine, cfg, metrics_path, fresh=True):
        self.total, self.engine, self.cfg = total, engine, cfg
        self.budget = engine.cfg.cpu_mem  # parsed once, by the engine's options
        self.metrics = open(metrics_path, "w" if fresh else "a")
        self.rows = []
        self.cpu = CpuClock()
        self.t_start = time.perf_counter()
        self.bar = _Silent()
