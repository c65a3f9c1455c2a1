"""Busy time per lane: one lane's overlapping events merged, and the compute thread's waits taken
out of the compute spans they sit in."""
import json
import time

import pytest

import tierlm
from tierlm.engine.timeline import Timeline, fmt_share


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


def test_a_stopped_window_is_the_step_and_cuts_what_lands_after(tmp_path):
    """stop(end) cuts events to the step's window; the window, not the last event, is the axis and
    the base of the shares, and a Chrome trace read back (the PNG's child) gives the same numbers."""
    tl = _timeline([("compute", "fwd", 1.0, 3.0), ("ssd_write", "tail", 3.0, 9.0), ("ssd_read", "late", 6.0, 7.0)])
    tl.stop(end=5.0)
    assert tl.span_s() == 5.0
    assert tl.events == [("compute", "fwd", 1.0, 3.0, 0, "t"), ("ssd_write", "tail", 3.0, 5.0, 0, "t")]
    shares = tl.lane_shares()
    assert shares["compute"] == 2.0 / 5.0 and shares["ssd_write"] == 2.0 / 5.0 and shares["ssd_read"] == 0.0
    back = Timeline.from_chrome(tl.save_chrome(tmp_path / "t.json"))
    assert back.span_s() == 5.0
    assert {k: fmt_share(v) for k, v in back.lane_shares().items()} == {k: fmt_share(v) for k, v in shares.items()}


def test_the_recorded_step_is_timed_like_its_neighbours_and_its_picture_says_so(tmp_path, monkeypatch, capsys):
    """The recorded step (2) against steps 3 and 4: each step made ~2 s long (a sleep in finish), so
    that noise is small beside 10%; the activation planner's one-off drive probe (after step 1) and
    drawing the picture (after step 2) take 3 s each, and neither may land in a step's time. The
    picture's title, window and shares are the step's metrics row and its log line."""
    from tierlm.bench import rates as act_rates
    from tierlm.engine.engine import Engine
    from tierlm.hf.init import init_model
    from tierlm.hf.presets import make_config

    step_s, delay = 2.0, 3.0
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))  # nothing cached: the recipe's probe runs
    finish = Engine.finish
    monkeypatch.setattr(Engine, "finish", lambda self: (time.sleep(step_s), finish(self))[1])
    probed = []

    def slow_probe(root, say=None):
        probed.append(root)
        time.sleep(delay)
        return act_rates.P.Rates(*act_rates.P.DEFAULT_RATES, "this test's")
    monkeypatch.setattr(act_rates, "activation_rates", slow_probe)
    titles = []
    draw = Timeline.save_png_in_child

    def slow_draw(self, json_path, png_path, title=""):
        titles.append(title)
        time.sleep(delay)
        return draw(self, json_path, png_path, title)
    monkeypatch.setattr(Timeline, "save_png_in_child", slow_draw)

    model = tmp_path / "model"
    init_model(model, make_config("llama", None, {"layers": 2, "hidden": 64}))
    data = tmp_path / "data.txt"
    data.write_text("\n".join(f"Record {i}: a step of the timeline." for i in range(200)))
    run = tmp_path / "run"
    tierlm.finetune(model=str(model), data=str(data), output=str(run), cpu_mem="256MiB", seq_len=24,
                    batch_size=2, steps=4, precision="fp32", timeline_step=2)
    assert probed and len(titles) == 1  # both delays happened
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    s = [r["s_per_step"] for r in rows]
    neighbours = (s[2] + s[3]) / 2
    assert abs(s[1] - neighbours) <= 0.1 * neighbours, s
    assert all(x < step_s + delay / 2 for x in s[1:]), s  # no delay in any step after the first

    tl = Timeline.from_chrome(run / "timeline.json")
    assert tl.span_s() == pytest.approx(s[1], abs=1e-6)  # the window is the step's own time
    assert all(0 <= t0 <= t1 <= tl.span_s() + 1e-6 for _, _, t0, t1, _, _ in tl.events)
    assert titles[0].startswith(f"step 2: {s[1]:.2f} s, ")
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("timeline of step 2"))
    assert f"({s[1]:.2f} s)" in line
    busy = dict(p.rsplit(" ", 1) for p in line.split("busy: ")[1].split(";")[0].split(", "))
    assert busy == {k: fmt_share(v) for k, v in tl.lane_shares().items()}  # the PNG's lane labels


def test_a_gpus_host_link_gets_its_lanes_only_where_copies_landed(tmp_path):
    """The swap copies of a GPU run ("d2h" out in forward, "h2d" back in backward) are lanes of their
    own, in the Chrome trace, the shares and the picture; a CPU run's lanes are unchanged."""
    from tierlm.engine.timeline import LANES
    cpu = _timeline([("compute", "fwd", 0.0, 1.0)])
    assert cpu.lanes() == LANES and "d2h" not in cpu.lane_shares()
    tl = _timeline([("compute", "fwd layers.0", 0.0, 2.0), ("d2h", "b0/0", 0.5, 1.0), ("d2h", "b0/1", 0.8, 1.5),
                    ("compute", "bwd layers.0", 2.0, 4.0), ("h2d", "b0/0", 2.0, 2.5)])
    tl.stop(end=4.0)
    assert tl.lanes() == LANES + ("d2h", "h2d")
    assert tl.lanes_busy_s()["d2h"] == 1.0 and tl.lanes_busy_s()["h2d"] == 0.5
    back = Timeline.from_chrome(tl.save_chrome(tmp_path / "t.json"))
    assert back.lanes() == tl.lanes() and back.lane_shares() == pytest.approx(tl.lane_shares())
    names = [e["args"]["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "M"]
    assert names[-2:] == ["d2h", "h2d"]
    png = back.save_png(tmp_path / "t.png", "a GPU step")
    assert png.stat().st_size > 0
