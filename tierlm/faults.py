"""Fault injection for the reliability tests: TIERLM_FAULT="point[:n[:action]][,...]".

At the n-th time (default 1st) the code passes `point`, the action runs: `kill` (SIGKILL this
process: a crash with no cleanup at all), `enospc` / `eio` (the write or fsync in progress fails as
a full or broken disk would), or `nan` (the caller poisons the loss). Unset, every check is one dict
lookup on an empty dict.
"""
from __future__ import annotations

import errno
import os
import signal
import threading

_lock = threading.Lock()
_counts: dict[str, int] = {}


def _parse(spec: str) -> dict[str, tuple[int, str]]:
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        bits = part.split(":")
        out[bits[0]] = (int(bits[1]) if len(bits) > 1 and bits[1] else 1, bits[2] if len(bits) > 2 else "kill")
    return out


_PLAN = _parse(os.environ.get("TIERLM_FAULT", ""))


def fault(point: str) -> str | None:
    """Count a pass through `point`; return the action when it fires (after doing `kill` itself)."""
    if not _PLAN or point not in _PLAN:
        return None
    n, action = _PLAN[point]
    with _lock:
        _counts[point] = _counts.get(point, 0) + 1
        hit = _counts[point] == n
    if not hit:
        return None
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action in ("enospc", "eio"):
        code = errno.ENOSPC if action == "enospc" else errno.EIO
        raise OSError(code, os.strerror(code))
    return action
