"""Learning-rate schedules with linear warm-up: cosine, linear, constant."""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")


def lr_multiplier(step: int, total_steps: int, name: str, warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if name not in SCHEDULES:
        raise ValueError(f"task.scheduler.name={name!r} is unknown: choose one of {SCHEDULES}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if name == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
