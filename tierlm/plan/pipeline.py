"""A pipelined step's time from its devices' times (the model is in planner.py's docstring)."""
from __future__ import annotations

from . import cost as C


def combine(devices: dict[str, float], layers: int) -> tuple[str, float]:
    """The binding device and the step: the busiest device's time plus the pipeline's fill and
    drain, one layer's worth of the others' work."""
    busy = {k: v for k, v in devices.items() if v > 0}
    binding = max(busy, key=busy.get)
    top = busy[binding]
    return binding, top + (sum(busy.values()) - top) / max(layers, 1)


def unhidden(r: C.Rates, devices: dict[str, float], res: dict) -> float:
    """Without a GPU the store's threads take cycles from the cores that compute: the shorter of
    CPU and SSD time is hidden only by the measured share (bench/overlap.py). Recorded in `res`."""
    if r.overlap >= 1.0 or not devices.get("ssd") or not devices.get("cpu"):
        return 0.0
    res["overlap_penalty"] = (1.0 - r.overlap) * min(devices["cpu"], devices["ssd"])
    return res["overlap_penalty"]
