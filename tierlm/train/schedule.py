"""Learning-rate schedules, as multipliers of the base rate (the LambdaLR convention).

The formulas are those of transformers' get_*_schedule_with_warmup, so a run here and a run with
`torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(...))` see the same learning rate, bit for bit.
"""
from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(schedule: str, warmup_steps: int, total_steps: int):
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return float(step) / float(max(1, warmup_steps))
        if schedule == "constant":
            return 1.0
        progress_den = float(max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return max(0.0, float(total_steps - step) / progress_den)
        progress = float(step - warmup_steps) / progress_den
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    return factor


def lr_at(base_lr: float, schedule: str, warmup_steps: int, total_steps: int, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based), computed as LambdaLR does."""
    return base_lr * lr_factor(schedule, warmup_steps, total_steps)(step)
