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
    assert clock.lap()["exited"] >= 0.25


def test_thread_names_map_to_components():
    assert component("tierlm-crc_1") == "checksums" and component("tierlm-write_3") == "io"
    assert component("tierlm-commit_0") == "commit" and component("Thread-7 (monitor)") == OTHER
