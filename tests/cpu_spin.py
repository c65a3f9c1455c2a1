"""Known CPU time on the calling thread, for tests of per-thread CPU counters (which the kernel
counts in 10 ms ticks: a tiny model's own work can read 0)."""
import functools
import time


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def after_spinning(fn, seconds: float):
    """fn, spending `seconds` of the caller's thread CPU before each call."""
    @functools.wraps(fn)
    def wrapped(*a, **k):
        spin(seconds)
        return fn(*a, **k)
    return wrapped
