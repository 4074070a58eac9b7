"""The Lightning Trainer of a training run: the hardware group's settings, the task's loop settings, the
strategy, the atomic checkpoint writer and the cluster plugins."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig, OmegaConf

from ..core.settings import RunLength
from . import slurm
from .after_validation import ResumeAfterValidation
from .checkpoint_io import AtomicCheckpointIO, checkpoint_callback
from .strategies import build_strategy

log = logging.getLogger(__name__)


def instantiate_all(group) -> list:
    """Every node of a config group (``callbacks``, ``logger``) instantiated; a node without ``_target_`` is
    skipped with one line."""
    out = []
    for name, node in (group or {}).items():
        if node is not None and "_target_" not in node:
            # settings left by an override (e.g. debug=fast) for a callback the chosen group does not have
            log.info("callbacks.%s has settings but no _target_ (not in the chosen callbacks group): skipped", name)
            continue
        if node is not None:
            made = instantiate(node)
            out.extend(made if isinstance(made, (list, tuple)) else [made])
    return out


def build_trainer(cfg: DictConfig, out: Path, loggers: list, callbacks: list) -> L.Trainer:
    """A Trainer from the hardware group's trainer settings and the task's loop settings."""
    trainer_kwargs = {**OmegaConf.to_container(cfg.hardware.trainer, resolve=True),
                      **OmegaConf.to_container(cfg.task.trainer, resolve=True)}
    strategy = build_strategy(trainer_kwargs)
    # a run shorter than log_every_n_steps still logs its loss (and gets a loss curve)
    steps = RunLength.given(trainer_kwargs).step_limit
    if steps is not None:
        trainer_kwargs["log_every_n_steps"] = min(trainer_kwargs.get("log_every_n_steps") or 50, steps)
    trainer_kwargs["enable_progress_bar"] = any(isinstance(c, ProgressBar) for c in callbacks)
    checkpoint = checkpoint_callback(out / "checkpoints", cfg.task.checkpoint_every_n_steps,
                                     cfg.task.get("keep_last_checkpoints", 0))
    return L.Trainer(
        default_root_dir=str(out), logger=loggers or False,
        callbacks=[*callbacks, checkpoint, _LogShortEpochRuns(), ResumeAfterValidation()],
        strategy=strategy, plugins=[AtomicCheckpointIO(), *slurm.cluster_plugins()], **trainer_kwargs,
    )


class _LogShortEpochRuns(L.Callback):
    """An epoch-based run (``max_steps=-1``) shorter than ``log_every_n_steps`` still logs its loss: the interval is
    capped at the run's optimizer steps once Lightning knows them (``build_trainer`` does it for ``max_steps``)."""

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.max_steps < 0:
            total = trainer.estimated_stepping_batches
            if math.isfinite(total):
                trainer.log_every_n_steps = max(1, min(trainer.log_every_n_steps, int(total)))
