"""When each resource was busy: compute per layer, the optimizer, SSD reads and writes, and with a
GPU its host link: device-to-host ("d2h") and host-to-device ("h2d") copies.

Recording is off until `start()`; events are appended from any thread (a list append is atomic
under the GIL). `save_chrome` writes a Chrome trace (open it in Perfetto or chrome://tracing), and
`save_png` a Gantt chart with one lane per resource: the picture that shows at a glance whether the
pipeline is full. `stall_s` is the time the compute thread spent waiting on I/O.

A recorded step is the window [origin, end] of the step's own time (the s/step of its log line
and metrics row): `start(origin)` and `stop(end)` take the loop's clock, events are cut to the
window, and the picture's axis, its title and each lane's share are of that window alone.
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

# Lanes in the order they are drawn.
LANES = ("compute", "wait", "optimizer", "ssd_read", "ssd_write", "act_copy", "act_write", "act_read")
# A GPU's host link, drawn (and shared out in the log line) only where a step recorded copies on it:
# a CPU-only run's picture and log line keep the lanes above.
LINK_LANES = ("d2h", "h2d")
COLORS = {"compute": "#4878d0", "wait": "#d65f5f", "optimizer": "#6acc64", "ssd_read": "#ee854a",
          "ssd_write": "#956cb4", "act_copy": "#8c613c", "act_write": "#dc7ec0", "act_read": "#797979",
          "d2h": "#d5bb67", "h2d": "#82c6e2"}


def fmt_share(x: float) -> str:
    """A lane's share of the step as the log line and the picture both print it."""
    return f"{100 * x:.0f}%"


class Timeline:
    def __init__(self):
        self.events: list[tuple] = []  # (lane, name, t0, t1, nbytes, thread)
        self.recording = False
        self.origin = time.perf_counter()
        self.end: float | None = None  # the window's end, once stopped

    def start(self, origin: float | None = None) -> None:
        """Record from now; the window starts at `origin` (perf_counter; default now), where the
        step's own clock started: time before the first event is then part of the picture too."""
        self.events = []
        self.origin = time.perf_counter() if origin is None else origin
        self.end = None
        self.recording = True

    def stop(self, end: float | None = None) -> None:
        """Stop recording; the window ends at `end` (default now) and events are cut to it: what
        lands after (a commit's last writes) belongs to the next step."""
        self.recording = False
        self.end = time.perf_counter() if end is None else end
        self.events = [(ln, nm, t0, min(t1, self.end), nb, th) for ln, nm, t0, t1, nb, th in self.events
                       if t0 < self.end]

    def span_s(self) -> float:
        """The window's length: the step's time once stopped, else up to the last event."""
        end = self.end if self.end is not None else max((e[3] for e in self.events), default=self.origin)
        return end - self.origin

    def event(self, lane: str, name: str, t0: float, t1: float, nbytes: int = 0) -> None:
        if self.recording and t1 > self.origin:
            # An I/O issued before recording started shows from the start of the window.
            self.events.append((lane, name, max(t0, self.origin), t1, nbytes, threading.current_thread().name))

    @contextmanager
    def span(self, lane: str, name: str):
        if not self.recording:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.event(lane, name, t0, time.perf_counter())

    def lanes(self) -> tuple[str, ...]:
        """The lanes drawn: LANES, and the host link's where any event landed on them."""
        used = {e[0] for e in self.events}
        return LANES + tuple(lane for lane in LINK_LANES if lane in used)

    def stall_s(self) -> float:
        return sum(t1 - t0 for lane, _, t0, t1, _, _ in self.events if lane == "wait")

    def lane_spans(self, lane: str) -> list[tuple[float, float]]:
        """The lane's busy intervals, overlapping events merged (several I/O threads). A wait inside
        a compute event (backward handing a gradient to an optimizer that is behind, within the
        layer's span) is cut out of compute: the thread stood still."""
        spans = _merged((t0, t1) for ln, _, t0, t1, _, _ in self.events if ln == lane)
        if lane == "compute":
            spans = _minus(spans, self.lane_spans("wait"))
        return spans

    def lanes_busy_s(self) -> dict[str, float]:
        return {lane: sum(t1 - t0 for t0, t1 in self.lane_spans(lane)) for lane in self.lanes()}

    def lane_shares(self) -> dict[str, float]:
        """Each lane's busy time as a share of the window (span_s)."""
        span = self.span_s()
        return {lane: busy / span if span > 0 else 0.0 for lane, busy in self.lanes_busy_s().items()}

    def save_chrome(self, path) -> Path:
        path = Path(path)
        lanes = self.lanes()
        tids = {lane: i for i, lane in enumerate(lanes)}
        ev = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tids[lane], "args": {"name": lane}}
              for lane in lanes]
        for lane, name, t0, t1, nbytes, thread in self.events:
            ev.append({"name": name, "cat": lane, "ph": "X", "pid": 0, "tid": tids[lane],
                       "ts": (t0 - self.origin) * 1e6, "dur": max(t1 - t0, 1e-7) * 1e6,
                       "args": {"bytes": nbytes, "thread": thread}})
        # the window's length, so a reader (the PNG's child process) draws the same axis and shares
        path.write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ms",
                                    "otherData": {"window_s": self.span_s()}}))
        return path

    @classmethod
    def from_chrome(cls, path) -> "Timeline":
        """The timeline a Chrome trace written by save_chrome describes."""
        tl = cls()
        tl.origin = 0.0
        trace = json.loads(Path(path).read_text())
        tl.end = trace.get("otherData", {}).get("window_s")  # absent in older traces: the last event's end
        for e in trace["traceEvents"]:
            if e.get("ph") == "X":
                t0 = e["ts"] / 1e6
                tl.events.append((e["cat"], e["name"], t0, t0 + e["dur"] / 1e6, e["args"].get("bytes", 0),
                                  e["args"].get("thread", "")))
        return tl

    def save_png_in_child(self, json_path, png_path, title: str = ""):
        """Draw the PNG in a short-lived process, returned running (the caller waits for it before
        it exits): matplotlib (~40 MiB) must not count against the training process's memory
        budget, and its ~1.7 s of importing and drawing (a 2-vCPU AMD EPYC) need not stop training.
        The child runs at the lowest CPU priority, so it takes the cores' idle time, not the steps'."""
        import subprocess
        import sys
        return subprocess.Popen([sys.executable, "-m", "tierlm.engine.timeline", str(json_path), str(png_path),
                                 title])

    def save_png(self, path, title: str = "") -> Path:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        fig, ax = plt.subplots(figsize=(14, 3.6))
        shares = self.lane_shares()
        span = self.span_s()
        lanes = self.lanes()
        for i, lane in enumerate(lanes):
            bars = [(t0 - self.origin, t1 - t0) for t0, t1 in self.lane_spans(lane)]
            ax.broken_barh(bars, (len(lanes) - 1 - i - 0.4, 0.8), facecolors=COLORS[lane])
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels([f"{lane} ({fmt_share(shares[lane])})" if span else lane for lane in reversed(lanes)])
        ax.set_xlabel("seconds")
        ax.set_xlim(0, span or 1)
        ax.set_title(title or "one step: busy time per resource")
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _merged(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for t0, t1 in sorted(spans):
        if out and t0 <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t1)
        else:
            out.append([t0, t1])
    return [(a, b) for a, b in out]


def _minus(spans: list[tuple[float, float]], cuts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged `spans` without the merged `cuts`."""
    out = []
    for a, b in spans:
        for c0, c1 in cuts:
            if c1 <= a or c0 >= b:
                continue
            if c0 > a:
                out.append((a, c0))
            a = max(a, c1)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


if __name__ == "__main__":
    import os
    import sys
    os.nice(19)  # beside a training run: idle time only (save_png_in_child)
    Timeline.from_chrome(sys.argv[1]).save_png(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
