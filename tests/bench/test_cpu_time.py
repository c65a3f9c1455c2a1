"""CPU seconds by component: a named thread's work is its component's, the main thread's is main's."""
import threading

from tests.cpu_spin import spin as _spin
from tierlm.bench.cpu_time import MAIN, OTHER, CpuClock, component


def test_each_threads_cpu_time_goes_to_its_component():
    clock = CpuClock()
    done, release = threading.Event(), threading.Event()

    def work():
        _spin(0.3)
        done.set()
        release.wait()  # alive when the clock reads: an ended thread's counters are gone

    th = threading.Thread(target=work, name="tierlm-optim_0")
    th.start()
    _spin(0.2)
    done.wait()
    spent = clock.lap()
    release.set()
    th.join()
    assert spent["optimizer"] >= 0.25 and spent[MAIN] >= 0.15, spent
    assert clock.lap().get("optimizer", 0.0) < 0.05  # a lap counts from the one before


def test_an_ended_threads_time_is_counted_as_exited():
    clock = CpuClock()
    th = threading.Thread(target=_spin, args=(0.3,), name="tierlm-read_0")
    th.start()
    th.join()
    _gone(th.native_id)
    assert clock.lap()["exited"] >= 0.25


def _gone(tid: int) -> None:
    """Until the kernel no longer lists the thread (a joined thread's OS thread may linger)."""
    import os
    import time
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_thread_python_has_finished_but_the_kernel_lists_keeps_its_component(monkeypatch):
    """Between Python's end of a thread (join returns) and its OS thread's exit, the kernel still
    lists a thread Python no longer knows: its time stays its component's, not torch's pool's."""
    started, go, spun, release = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def work():
        started.set()
        go.wait()  # spins only after the clock's first reading
        _spin(0.3)
        spun.set()
        release.wait()

    th = threading.Thread(target=work, name="tierlm-write_0")
    th.start()
    started.wait()
    clock = CpuClock()  # it has seen the thread by name
    go.set()
    spun.wait()
    live = threading.enumerate()
    monkeypatch.setattr(threading, "enumerate", lambda: [t for t in live if t is not th])  # Python: gone
    spent = clock.lap()
    release.set()
    th.join()
    assert spent.get("io", 0.0) >= 0.25 and spent.get("torch_threads", 0.0) < 0.1, spent


def test_thread_names_map_to_components():
    assert component("tierlm-crc_1") == "checksums" and component("tierlm-write_3") == "io"
    assert component("tierlm-commit_0") == "commit" and component("Thread-7 (monitor)") == OTHER
