"""Windows of routed-token counts (per expert, all ranks summed) that survive a resume.

A callback that reports the tokens routed since its last report reads the MoE layers' monotonic ``total_counts``
(plain per-rank tensors, not in the checkpoint: a resumed process starts them at zero). The counts of the window's
steps before a checkpoint are therefore summed over the ranks when the checkpoint is written and travel in it
(:meth:`CountWindow.state`); the resumed window adds them to what it counts itself, so the first report after a
resume covers the same steps, with the same counts, as in an uninterrupted run.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch

log = logging.getLogger("moe_lab.callbacks")


def reduced(trainer: pl.Trainer, delta: torch.Tensor) -> torch.Tensor:
    """``delta`` summed over the data-parallel ranks, as a CPU int64 tensor (a collective: every rank calls it)."""
    return trainer.strategy.reduce(delta.clone(), reduce_op="sum").detach().to("cpu", torch.long)


class CountWindow:
    """Counts since the window opened at optimizer step ``start``: this rank's ``total_counts`` minus ``base``,
    summed over ranks, plus ``carried`` (all ranks' counts of the window before a resume)."""

    def __init__(self) -> None:
        self.base: torch.Tensor | None = None
        self.carried: torch.Tensor | None = None
        self.start = 0

    def open(self, totals: torch.Tensor, step: int, carried: torch.Tensor | None = None) -> None:
        self.base, self.start, self.carried = totals, int(step), carried

    def counts(self, trainer: pl.Trainer, totals: torch.Tensor) -> torch.Tensor:
        """All ranks' counts since the window opened (a collective); the window is left open."""
        flat = reduced(trainer, totals - self.base.to(totals.device))
        return flat if self.carried is None else flat + self.carried

    def close(self, trainer: pl.Trainer, totals: torch.Tensor, step: int) -> tuple[int, torch.Tensor]:
        """``(start step, all ranks' counts)`` of the window, and a new window opened at ``step``."""
        start, flat = self.start, self.counts(trainer, totals)
        self.open(totals, step)
        return start, flat

    def state(self, trainer: pl.Trainer, totals: torch.Tensor) -> dict[str, Any]:
        """What a checkpoint keeps of the window (a collective: call it on every rank, as checkpoints are
        written, ``Trainer.save_checkpoint``)."""
        return {"start": self.start, "counts": self.counts(trainer, totals)}

    def resume(self, totals: torch.Tensor, step: int, state: dict[str, Any] | None, name: str) -> None:
        """Open the window at a resume: continuing the checkpoint's window ``state`` when it has this model's
        layout (otherwise, with one log line, a new window at ``step``)."""
        counts = None if state is None else state.get("counts")
        if counts is not None and tuple(counts.shape) == tuple(totals.shape):
            self.open(totals, state["start"], counts.to("cpu", torch.long))
            return
        if state is not None:
            log.warning("%s: the checkpoint's count window has %s counts, this model %d: a new window starts at the "
                        "resumed step %d", name, None if counts is None else tuple(counts.shape),
                        totals.numel(), step)
        self.open(totals, step)
