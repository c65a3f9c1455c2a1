"""Which steps commit (`--commit-every`), and with `auto` the interval picked from what the first
steps measured: the step's time, the file-system sync and manifest, and the state the cache keeps
in RAM (written once per commit instead of every step). The interval never changes a result (a
resume replays the steps since the last commit to the same bits), so timings may pick it."""
from __future__ import annotations

import time

from ..plan.activations import DEFAULT_RATES
from ..plan.durability import CommitEvery, auto_interval, commit_cost_s, due, parse_commit_every
from ..units import fmt_bytes

AUTO_AFTER = 2  # steps measured (each committing) before auto picks the interval


class CommitSchedule:
    def __init__(self, spec: str, measured=None, dist: bool = False):
        every = parse_commit_every(spec)
        self.forced_why = ""
        if dist and not every.every_step:
            # ranks agree on each commit through collectives; a per-rank clock or cost could differ
            every, self.forced_why = CommitEvery(steps=1), "data-parallel ranks commit every step"
        self.every = every
        self.write_bps, self.rate_why, self._assumed = _write_rate(measured)
        self.auto_steps = 1
        self.why = self._describe()
        self.steps_since = 0
        self.done = 0            # steps ended
        self.t_commit = time.perf_counter()
        self._t_step = time.perf_counter()
        self.step_s: list[float] = []
        self.manifest_s: list[float] = []

    def measured_rates(self, rates, took_s: float = 0.0) -> None:
        """The drive's rates, measured after the schedule was made (the activation planner's probe
        after step 1, before the interval is picked): they price the commits where nothing did.
        `took_s`, the probe's own time, falls between two steps' ends: it is not the next step's, whose
        time prices the interval (a 5 s probe had made a 2 s step read 7 s)."""
        self._t_step += took_s
        if self._assumed and rates is not None and rates.ssd_write > 0:
            self.write_bps, self.rate_why = rates.ssd_write, f"{rates.ssd_write / 1e9:.2f} GB/s ({rates.source})"
            self._assumed = False

    @property
    def every_step(self) -> bool:
        return self.every.every_step

    def due(self, next_step: int, forced: bool) -> bool:
        """Does step `next_step` (1-based), about to run, commit? (forced: the trainer's last step.)"""
        if self.every.auto and self.done < AUTO_AFTER:
            return True
        return forced or due(self.every, self.auto_steps, next_step, self.steps_since,
                             time.perf_counter() - self.t_commit)

    def step_ended(self, durable: bool, kept_bytes: int) -> None:
        now = time.perf_counter()
        self.step_s.append(now - self._t_step)
        self._t_step = now
        self.done += 1
        self.steps_since = 0 if durable else self.steps_since + 1
        if durable:
            self.t_commit = now
        if self.every.auto and self.done == AUTO_AFTER:
            self._pick(kept_bytes)

    def _pick(self, kept_bytes: int) -> None:
        """The interval from the last measured step (the first creates the files of both slots)."""
        fixed = max(self.manifest_s) if self.manifest_s else 0.0
        cost = commit_cost_s(kept_bytes, self.write_bps, fixed)
        step = self.step_s[-1]
        self.auto_steps = auto_interval(cost, step)
        self.why = (f"auto: every {self.auto_steps} step{'s' if self.auto_steps > 1 else ''}: a commit costs "
                    f"~{cost:.2f} s ({fmt_bytes(kept_bytes)} of state kept in RAM at {self.rate_why}, sync and "
                    f"manifest {fixed:.2f} s), at most 5% of {self.auto_steps} x {step:.2f} s steps")

    def _describe(self) -> str:
        if self.forced_why:
            return f"every step ({self.forced_why})"
        if self.every.auto:
            return f"auto: every step for the first {AUTO_AFTER}, then picked from their cost"
        if self.every.seconds is not None:
            return f"--commit-every {self.every.describe()}: the first step to start after that much time commits"
        return f"--commit-every {self.every.steps}"


def _write_rate(measured) -> tuple[float, str, bool]:
    """(bytes/s, where it came from, whether it is assumed: nothing measured it)."""
    io = getattr(measured, "io", None) or {}
    if io.get("write_gbps"):
        return io["write_gbps"] * 1e9, f"{io['write_gbps']:.2f} GB/s (tierlm bench io)", False
    rates = getattr(measured, "activation_rates", None)
    if rates is not None:
        return rates.ssd_write, f"{rates.ssd_write / 1e9:.2f} GB/s ({rates.source})", False
    return (DEFAULT_RATES[1], f"an assumed {DEFAULT_RATES[1] / 1e9:.1f} GB/s (`tierlm bench io --nvme DIR` measures it)",
            True)
