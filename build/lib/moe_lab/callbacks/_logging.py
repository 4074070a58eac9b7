"""Writing callback metrics straight to the trainer's loggers, on Lightning's step axis.

Why not ``pl_module.log_dict(on_step=True)`` alone: Lightning keeps every ``on_step`` value in its
result collection until the epoch ends and re-sends it at *every* logger flush
(``global_step % trainer.log_every_n_steps == 0``). A metric logged every 10 steps would therefore
show up again, stale, at the 9 flushes in between with ``log_every_n_steps=1``, and be dropped at steps
that are not flushes. The callbacks therefore still call ``log_dict(..., logger=False)`` (so the values
reach ``trainer.callback_metrics`` for monitoring) and write to the loggers themselves, exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning itself logs step metrics with (``train/loss`` of the k-th batch is at k - 1).

    It is the number of optimizer steps completed *before* the current batch's step, identical in
    ``on_before_optimizer_step`` and in ``on_train_batch_end`` of the same batch.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return int(step) if step is not None else max(trainer.global_step - 1, 0)


def ends_training(trainer: pl.Trainer) -> bool:
    """True in ``on_train_batch_end`` of the optimizer step that ends the fit by its limits: ``max_steps``
    reached, or the last batch of the last epoch (``max_epochs``).

    The callbacks write their end-of-training logging here rather than in ``on_train_end``: it then comes
    before the checkpoint of that step (``LastStepCheckpoint``, Lightning's epoch-end save), so a run killed
    after its last checkpoint has lost nothing, and a resume from that checkpoint, which trains nothing
    (Lightning skips the fit loop and ``on_train_end``), need not write it. ``on_train_end`` stays the
    fallback for other ends (early stopping, ``trainer.should_stop``)."""
    max_steps, max_epochs = getattr(trainer, "max_steps", None), getattr(trainer, "max_epochs", None)
    if max_steps is not None and 0 < max_steps <= trainer.global_step:
        return True
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    last_batch = getattr(getattr(loop, "batch_progress", None), "is_last_batch", False) is True
    return bool(max_epochs is not None and max_epochs >= 0 and last_batch
                and getattr(trainer, "current_epoch", 0) + 1 >= max_epochs)


def wandb_loggers(trainer: pl.Trainer) -> list[WandbLogger]:
    return [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]


def log_metrics(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    metrics: Mapping[str, float],
    step: int,
    wandb_extra: Mapping[str, Any] | None = None,
) -> None:
    """Log scalar ``metrics`` once at ``step`` to every logger (rank zero), plus ``wandb_extra`` (e.g.
    ``wandb.Histogram`` objects) to W&B loggers in the same W&B row; mirror the scalars into
    ``trainer.callback_metrics``."""
    if not metrics and not wandb_extra:
        return
    if metrics:
        pl_module.log_dict(dict(metrics), on_step=True, on_epoch=False, sync_dist=False, logger=False)
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        payload: dict[str, Any] = dict(metrics)
        if wandb_extra and isinstance(logger, WandbLogger):
            payload.update(wandb_extra)
        if payload:
            logger.log_metrics(payload, step=step)
            logger.save()
