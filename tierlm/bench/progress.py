"""Saying what a measurement measures and for how long, before it runs and while it runs.

A measurement of more than a couple of seconds must not look like a hang: `Stages` prints one line
naming what is measured and about how long it takes, then shows the stages as they go: a tqdm bar
(seconds of the estimate done, the stage running) where stderr is a terminal, one plain line per
stage elsewhere (logs, pipes, CI), so a log still says where a slow measurement spent its time.
The estimates are the measurements' own sizes at assumed rates; `rescale` corrects the stages left
once one of them has shown how fast this machine really is.
"""
from __future__ import annotations

import sys
import time


class Stages:
    def __init__(self, title: str, stages: list[tuple[str, float]], note: str = "", quiet: bool = False,
                 out=None):
        self.title, self.names = title, [n for n, _ in stages]
        self.est = [float(s) for _, s in stages]
        self.quiet, self.out = quiet, out or sys.stderr
        self.i, self.t0, self.bar = 0, time.perf_counter(), None
        if quiet:
            return
        self._line(f"{title}: measures {'; '.join(self.names)}: about {_dur(sum(self.est))}"
                   + (f" ({note})" if note else ""))
        if getattr(self.out, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=round(sum(self.est), 1), unit="s", file=self.out, leave=False,
                                bar_format="{desc} {bar} {elapsed} of ~{total:.0f} s")
            except ImportError:
                self.bar = None

    def _line(self, msg: str) -> None:
        print(msg, file=self.out, flush=True)

    def rescale(self, factor: float, names: set[str] | None = None) -> None:
        """Multiply the estimates of the stages not yet run (those in `names`, or all) by `factor`."""
        for j in range(self.i, len(self.est)):
            if names is None or self.names[j] in names:
                self.est[j] *= factor
        if self.bar is not None:
            self.bar.total = round(sum(self.est), 1)
            self.bar.refresh()

    def __call__(self, fn, *args, **kwargs):
        """Run the next stage: fn(*args, **kwargs), announced and timed."""
        name, est = self.names[self.i], self.est[self.i]
        if self.bar is not None:
            self.bar.set_description_str(f"{self.title} [{self.i + 1}/{len(self.names)}] {name}")
        elif not self.quiet:
            self._line(f"  [{self.i + 1}/{len(self.names)}] {name} (~{_dur(est)}) ...")
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.took = time.perf_counter() - t0
            if self.bar is not None:
                self.bar.update(round(est, 1))
            self.i += 1
            if self.i == len(self.names):
                self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not self.quiet and self.i == len(self.names):
            self._line(f"{self.title}: done in {_dur(time.perf_counter() - self.t0)}")
            self.quiet = True  # said once


def _dur(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"
