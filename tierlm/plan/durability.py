"""How often a fine-tuning run makes its state durable (`--commit-every`), as arithmetic.

Between commits a step writes only what the budget cannot keep in RAM (and the working weights);
the optimizer state the cache holds stays in RAM, and a commit writes it, syncs the file system and
writes the manifest. A kill loses the steps since the last commit: the run resumes there and
replays them to the same bits. The interval trades that replay against the commit's cost; it never
changes a result, so `auto` may pick it from timings: the shortest interval whose commit costs at
most `AUTO_SHARE` of the training time.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

AUTO_SHARE = 0.05      # a commit may cost this share of the training time between commits
AUTO_MAX_STEPS = 1000  # ... and auto never leaves more steps than this to replay
AUTO_MAX_S = 1800.0    # ... nor more than this much training time


@dataclass(frozen=True)
class CommitEvery:
    """steps: commit every this many steps; seconds: once this much time has passed since the last
    commit; auto: the interval is picked from the measured commit cost (auto_interval)."""
    steps: int | None = None
    seconds: float | None = None
    auto: bool = False

    @property
    def every_step(self) -> bool:
        return self.steps == 1

    def describe(self) -> str:
        if self.auto:
            return "auto"
        if self.seconds is not None:
            return f"{self.seconds / 60:g}min"
        return str(self.steps)


_TIME = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|sec|min|m|h)$")


def parse_commit_every(spec: str | int) -> CommitEvery:
    """'auto', a number of steps ('1', '50') or a time ('30s', '10min', '1h')."""
    text = str(spec).strip().lower()
    if text == "auto":
        return CommitEvery(auto=True)
    if text.isdigit() and int(text) >= 1:
        return CommitEvery(steps=int(text))
    m = _TIME.match(text)
    if m and float(m.group(1)) > 0:
        unit = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[m.group(2)]
        return CommitEvery(seconds=float(m.group(1)) * unit)
    raise ValueError(f"--commit-every {spec!r}: use auto, a number of steps (e.g. 50) or a time "
                     f"(e.g. 10min, 30s, 1h)")


def commit_cost_s(kept_state_bytes: int, write_bps: float, fixed_s: float) -> float:
    """What a commit adds to the steps between: the state kept in RAM written once (at the drive's
    write rate), plus the file-system sync and the manifest (measured)."""
    return kept_state_bytes / write_bps + fixed_s if write_bps > 0 else fixed_s


def auto_interval(commit_s: float, step_s: float, share: float = AUTO_SHARE) -> int:
    """The fewest steps between commits for which one commit costs at most `share` of their time."""
    if step_s <= 0:
        return 1
    n = max(1, math.ceil(commit_s / (share * step_s) - 1e-9))
    return int(min(n, AUTO_MAX_STEPS, max(1, AUTO_MAX_S // step_s)))


def due(every: CommitEvery, auto_steps: int, next_step: int, steps_since: int, seconds_since: float) -> bool:
    """Does step `next_step` (1-based), the `steps_since + 1`-th since the last commit, commit? A
    number of steps commits the steps that are its multiples, wherever the run resumed."""
    if every.seconds is not None:
        return seconds_since >= every.seconds
    if every.auto:
        return steps_since + 1 >= auto_steps
    return next_step % every.steps == 0
