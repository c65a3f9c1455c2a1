"""Ordering the store's requests on its thread pools: a request that starts once others are done,
and a Future that follows work handed on as another Future.

A read of a key waits for its write in flight, and a write in place for the reads of the bytes it
replaces; these helpers chain such requests without a thread blocked on each dependency.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .records import StorageError


def settle(out: Future, f: Future) -> None:
    """Settle `out` as `f` did; a Future result (work handed on) is followed."""
    exc = f.exception()
    if exc is not None:
        out.set_exception(exc)
        return
    r = f.result()
    if isinstance(r, Future):
        r.add_done_callback(lambda g: settle(out, g))
    else:
        out.set_result(r)


def submit(executor: ThreadPoolExecutor, fn, *args) -> Future:
    """fn(*args) on `executor`; when fn hands its result on as a Future, the returned one settles
    with that."""
    out: Future = Future()
    executor.submit(fn, *args).add_done_callback(lambda f: settle(out, f))
    return out


def after(executor: ThreadPoolExecutor, deps: list[Future], where: Path, fn, *args) -> Future:
    """fn(*args) on `executor` once every future in `deps` is done (failed or not); `where` names
    the file in the error when the executor was shut down meanwhile."""
    if not deps:
        return submit(executor, fn, *args)
    out: Future = Future()
    left = [len(deps)]
    lock = threading.Lock()
    # A done future keeps its callbacks: `start` must not keep the job (a tensor to write) alive
    # for as long as a dependency is referenced (the swapper writes a key every step).
    job = [fn, args]

    def start(_):
        with lock:
            left[0] -= 1
            if left[0]:
                return
        run, run_args = job
        job.clear()
        try:
            inner = executor.submit(run, *run_args)
        except RuntimeError as e:  # the store was closed meanwhile
            out.set_exception(StorageError(f"{where}: store closed before the I/O ran ({e})"))
            return
        inner.add_done_callback(lambda f: settle(out, f))
    for d in deps:
        d.add_done_callback(start)
    return out
