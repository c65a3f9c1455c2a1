"""The store's I/O threads: queued reads before queued writes, FIFO within each, all run on shutdown."""
import threading

from tierlm.storage.ioqueue import READ, WRITE, IOQueue


def test_queued_reads_run_before_queued_writes_and_shutdown_drains():
    q = IOQueue(1, "t")
    gate, ran = threading.Event(), []
    q.submit(gate.wait, priority=WRITE)  # holds the one thread while the rest queue up
    futs = [q.submit(ran.append, name, priority=p)
            for name, p in [("w1", WRITE), ("r1", READ), ("w2", WRITE), ("r2", READ)]]
    gate.set()
    q.shutdown(wait=True)
    assert all(f.done() for f in futs)
    assert ran == ["r1", "r2", "w1", "w2"]


def test_an_error_reaches_the_future():
    q = IOQueue(2, "t")
    f = q.submit(lambda: 1 / 0)
    assert isinstance(f.exception(timeout=5), ZeroDivisionError)
    q.shutdown()
