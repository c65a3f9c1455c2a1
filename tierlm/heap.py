"""Freed heap memory kept for reuse while training is under its budget, handed back when it is not.

tierlm's import settings (`tierlm.malloc`) give every allocation over 64 KiB fresh pages and
return them on free, so RSS tracks what is live. The price is paid by the compute: the kernel zeroes
every fresh page, and a step's transient tensors are mostly 64 KiB-32 MiB. Qwen2.5-0.5B at 4x448
tokens in bf16 (2 vCPUs) faulted 1.27-1.37M small pages and 12 GiB of huge pages a step. With those
allocations kept in the heap under this guard (and head_loss's reused buffers), 0.18-0.25M and
4.8-5.8 GiB, and the step 26.8-28.8 -> 24.9-27.0 s (docs/benchmarks.md at a2b1c1e, "Fewer fresh pages a step").

Unbounded, the heap's holes held 1.3-2.3 GiB more and the run peaked over its --cpu-mem. So while an
Engine trains, `check()` runs between blocks: past `limit` (the budget less one block's transient
compute, which the next block may add before the next check), the free pages go back to the OS.
"""
from __future__ import annotations

import ctypes
import os
import threading

from . import malloc

# glibc mallopt parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# Blocks up to this size come from the heap while training; glibc's own ceiling for its dynamic
# threshold. Larger ones (a big embedding's gradient, the head's logits) stay mmapped and go back on free.
KEEP_BELOW = 32 << 20
# Kept blocks strand memory in holes within a block's own compute, between two checks: the 96 MiB
# test budget (tests/train/test_budget.py) and the demo's 160 MiB went 22 and 11 MiB over with
# the guard, where Qwen2.5-0.5B's 4 GiB peaked no higher than without it. Budgets whose compute
# share is below this keep tierlm's import settings. The share is the transient part
# (Split.transient): a tied head's held gradient is live, not freed between checks. Counting it,
# Qwen2.5-0.5B at 1x32 tokens (a 352 MiB share, 260 MiB of it held) kept holes while backward
# waited on the optimizer, where no check runs, and peaked 4.06-4.14 GiB beyond the libraries of
# its 4 GiB; with the guard off, 3.90-3.92.
MIN_COMPUTE_SHARE = 256 << 20
KEEP_TOP = (1 << 31) - 1  # M_TRIM_THRESHOLD is a C int: the largest, 2 GiB free at the top before free() trims

_PAGE = os.sysconf("SC_PAGE_SIZE")
_lock = threading.Lock()
_open_guards = 0


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_statm: list = [None, None]  # (pid, descriptor): /proc/self resolves at open, so a forked child reopens


def rss() -> int:
    """Resident bytes now (statm: cheaper than psutil, which the checks between blocks would feel).
    Read through a kept descriptor: 1.4 us a read against 14 us opening the file each time, which
    an inference step's check before each of its layers would feel (0.3 ms a step of 22 layers)."""
    pid = os.getpid()
    if _statm[0] != pid:
        _statm[:] = [pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)]
    return int(os.pread(_statm[1], 256, 0).split()[1]) * _PAGE


class HeapGuard:
    """While open: heap blocks under KEEP_BELOW are reused, not returned; `check()` returns them
    when RSS passes `limit`. A no-op where tierlm's malloc settings are off (TIERLM_MALLOC=glibc,
    or no glibc: glibc's defaults keep freed memory already) and where the budget's compute share
    (one block's transient tensors) is under `min_share` (MIN_COMPUTE_SHARE for training)."""

    def __init__(self, limit: int, compute_share: int, min_share: int = MIN_COMPUTE_SHARE, keep_top: bool = False):
        self.limit = limit
        self.trims = 0
        self.libc = _libc() if malloc.MALLOC_TAMED and compute_share >= min_share else None
        self.open = self.active = self.libc is not None  # active: whether it ever kept anything
        if self.open:
            global _open_guards
            with _lock:
                _open_guards += 1
                self.libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW)
                # 0: free() still returns the top of the heap; the holes below it wait for check().
                # (This read 1 << 40, which ctypes masks to a C int: 0. Every training measurement
                # ran so; keeping the top in training, 271M at 4x512 under 2 GiB, was not faster:
                # 13.20 and 13.16 s a step against 12.52 and 12.93, the same peak.)
                # keep_top: the top of the heap is kept too (free() returns nothing; check() does),
                # for steps whose every layer frees and asks again for the same sizes (inference)
                self.libc.mallopt(M_TRIM_THRESHOLD, KEEP_TOP if keep_top else 0)

    def check(self) -> bool:
        """Hand the free heap back if RSS is past the limit; True if it did."""
        if not self.open or rss() <= self.limit:
            return False
        self.libc.malloc_trim(0)
        self.trims += 1
        return True

    def close(self) -> None:
        """tierlm's import settings again (once no other guard is open), and the free heap returned."""
        if not self.open:
            return
        self.open = False
        global _open_guards
        with _lock:
            _open_guards -= 1
            if _open_guards == 0:
                self.libc.mallopt(M_MMAP_THRESHOLD, malloc.TAME_MMAP_THRESHOLD)
                self.libc.mallopt(M_TRIM_THRESHOLD, malloc.TAME_TRIM_THRESHOLD)
        self.libc.malloc_trim(0)
