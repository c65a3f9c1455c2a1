"""What every probe shares: the unit its rates are given in, and the timing that keeps a probe's
quiet moments."""
from __future__ import annotations

import time

GB = 1e9


def best_seconds(fn, repeats: int) -> float:
    """The shortest of `repeats` timings of fn() (a probe keeps the quiet moments)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
