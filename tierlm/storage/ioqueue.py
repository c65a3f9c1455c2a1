"""The store's I/O threads: queued reads run before queued writes.

A step's last writes land while the next forward reads its weights (the engine defers them), and
in a FIFO pool those reads waited behind every write queued before them: the forward stood still
for the first 0.2 s of a TinyLlama step (1x128, 4 GiB) with only writes moving. The writes lose
nothing by going second: the forward reads at the pace of its compute and leaves the drive room.
Order between requests for one file is not the queue's business: the store chains those on
futures (a read waits for the write in flight, a write for the reads in flight).
"""
from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future

READ, WRITE = 0, 1


class IOQueue:
    def __init__(self, workers: int, name: str):
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args, priority: int = WRITE) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("cannot schedule new I/O after shutdown")
            heapq.heappush(self._heap, (priority, next(self._seq), fut, fn, args))
            self._cv.notify()
        return fut

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return  # closed, and everything queued has run
                _, _, fut, fn, args = heapq.heappop(self._heap)
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 (handed to whoever waits on it)
                    fut.set_exception(e)
            # an idle thread must not keep the last job's tensors alive while it waits
            del fut, fn, args

    def shutdown(self, wait: bool = True) -> None:
        """No new work; what is queued still runs (as ThreadPoolExecutor.shutdown does)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()
