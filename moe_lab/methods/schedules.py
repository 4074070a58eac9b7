"""Learning-rate schedules as HF/TRL trainers run them: linear warm-up from 0, then cosine, linear or constant.

The multiplier at optimizer step ``s`` (0-based, the value ``LambdaLR`` uses for that step) is
``s / warmup`` during warm-up and afterwards ``min + (1 - min) * f``, with ``f`` the half cosine of
``(s - warmup) / (total - warmup)`` or the linear ramp ``(total - s) / (total - warmup)``, exactly
``transformers.get_{cosine,linear,constant}_schedule_with_warmup`` (and ``get_cosine_with_min_lr_schedule_with_
warmup`` for ``min_lr_ratio``). With ``min_lr_ratio=0`` the rate reaches 0 after the last optimizer step.
HF has no linear schedule with a floor, hence this one function for all three.
"""

from __future__ import annotations

import math

from ..core.settings import SCHEDULES

__all__ = ["SCHEDULES", "lr_multiplier", "warmup_steps_for"]


def warmup_steps_for(total_steps: int, warmup_steps: int = 0, warmup_ratio: float | None = None) -> int:
    """Warm-up length: ``ceil(warmup_ratio * total_steps)`` when a ratio is set (as HF's TrainingArguments),
    else ``warmup_steps``."""
    if warmup_ratio is None:
        if int(warmup_steps) < 0:
            raise ValueError(f"task.scheduler.warmup_steps={warmup_steps} must be >= 0")
        return int(warmup_steps)
    if not 0.0 <= float(warmup_ratio) <= 1.0:
        raise ValueError(f"task.scheduler.warmup_ratio={warmup_ratio} must be in [0, 1]")
    return math.ceil(total_steps * float(warmup_ratio))


def lr_multiplier(step: int, total_steps: int, name: str, warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if name not in SCHEDULES:
        raise ValueError(f"task.scheduler.name={name!r} is unknown: choose one of {SCHEDULES}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"task.scheduler.min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if name == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    if name == "linear":
        factor = max(0.0, (total_steps - step) / span)
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * ((step - warmup_steps) / span)))
    return max(0.0, min_lr_ratio + (1.0 - min_lr_ratio) * factor)
