"""Busy time per lane: one lane's overlapping events merged, and the compute thread's waits taken
out of the compute spans they sit in."""
from tierlm.engine.timeline import Timeline


def _timeline(events):
    tl = Timeline()
    tl.origin = 0.0
    tl.events = [(lane, name, t0, t1, 0, "t") for lane, name, t0, t1 in events]
    return tl


def test_io_threads_overlapping_count_once():
    tl = _timeline([("ssd_read", "a", 0.0, 2.0), ("ssd_read", "b", 1.0, 3.0), ("ssd_read", "c", 5.0, 6.0)])
    assert tl.lanes_busy_s()["ssd_read"] == 4.0


def test_a_wait_inside_a_layers_backward_is_not_compute():
    tl = _timeline([("compute", "bwd layers.1", 0.0, 10.0), ("wait", "gradients in flight", 2.0, 3.0),
                    ("wait", "gradients in flight", 9.5, 11.0), ("compute", "bwd layers.0", 11.0, 12.0)])
    assert tl.lane_spans("compute") == [(0.0, 2.0), (3.0, 9.5), (11.0, 12.0)]
    busy = tl.lanes_busy_s()
    assert busy["compute"] == 9.5 and busy["wait"] == 2.5
    assert tl.stall_s() == 2.5
