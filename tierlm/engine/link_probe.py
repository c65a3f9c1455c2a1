"""The GPU's host link as the activation swapper uses it: pinned host <-> device copies.

Measured once, where the engine profiles (after the first profiled step), with the size of one
layer's activations, so the planner prices a swap at the rate its copies run at on this machine
and this bus (a PCIe 4 x16 card and a PCIe 5 one differ by 2x; a datasheet figure cannot say
which slot the card sits in)."""
from __future__ import annotations

import time

import torch

from ..storage.aligned import aligned_empty

REPEATS = 3  # copies timed per direction, after one untimed (first-touch, driver set-up)


def measure_link(device: torch.device, nbytes: int) -> tuple[float, float]:
    """(device -> host, host -> device) bytes/s of a pinned copy of `nbytes`, the best of REPEATS:
    the link's rate, which a copy disturbed by other traffic only hides."""
    host = aligned_empty(nbytes, pin=True)[:nbytes]
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    # both buffers are freed on return (the device's back to the caching allocator)
    return _best(lambda: host.copy_(dev), device, nbytes), _best(lambda: dev.copy_(host), device, nbytes)


def _best(copy, device: torch.device, nbytes: int) -> float:
    torch.cuda.synchronize(device)
    copy()
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        copy()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
