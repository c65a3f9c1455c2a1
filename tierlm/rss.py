"""This process's memory: resident set now, its high-water mark, and handing freed heap back.

Every budget is a promise about RSS, so the engines, the recipes and the benchmarks all read it here."""
from __future__ import annotations

import ctypes
import resource

import psutil


def current_rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """This process's peak RSS: the kernel's high-water mark of its memory map (VmHWM).

    ru_maxrss would do, except that Linux carries it across exec: a process started from a large
    parent (pytest with torch loaded) would report the parent's size as its own peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trim() -> None:
    """Hand freed heap memory back to the OS now (after tokenisation's transient peak)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
