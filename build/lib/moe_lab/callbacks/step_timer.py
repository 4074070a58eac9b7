"""Wall time of every training batch (forward, backward and optimizer step), for step-cost ratios."""

from __future__ import annotations

import statistics
import time

import lightning.pytorch as pl


class StepTimerCallback(pl.Callback):
    """Records each training batch's wall time; ``median_s`` skips the first ``skip`` (warm-up) batches."""

    def __init__(self, skip: int = 2):
        self.skip = skip
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)

    @property
    def median_s(self) -> float | None:
        kept = self.times[self.skip:] or self.times
        return statistics.median(kept) if kept else None
