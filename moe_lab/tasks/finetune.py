"""task=finetune: train an MoE model with one method, then export a vanilla-loadable checkpoint."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from ..callbacks.step_timer import StepTimerCallback
from ..models import load_model
from .checkpoint_io import AtomicCheckpointIO


def _instantiate_all(group) -> list:
    return [instantiate(node) for node in (group or {}).values() if node is not None]


def build_trainer(cfg: DictConfig, out: Path, loggers: list, callbacks: list) -> L.Trainer:
    """A Trainer from the hardware group's trainer settings and the task's loop settings."""
    trainer_kwargs = {**OmegaConf.to_container(cfg.hardware.trainer, resolve=True),
                      **OmegaConf.to_container(cfg.task.trainer, resolve=True)}
    strategy = trainer_kwargs.pop("strategy", "auto")
    if isinstance(strategy, dict):
        strategy = instantiate(strategy)
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, save_top_k=0,
                                 every_n_train_steps=cfg.task.checkpoint_every_n_steps)
    return L.Trainer(
        default_root_dir=str(out), logger=loggers or False, callbacks=[*callbacks, checkpoint],
        strategy=strategy, plugins=[AtomicCheckpointIO()], **trainer_kwargs,
    )


def finetune(cfg: DictConfig) -> dict:
    """Train ``cfg.model`` with ``cfg.method`` on ``cfg.dataset``; write metrics, plots and ``export/``."""
    out = Path(cfg.paths.output_dir)
    L.seed_everything(cfg.seed, workers=True)
    model, tokenizer = load_model(cfg.model)
    datamodule = instantiate(cfg.dataset, tokenizer=tokenizer)
    module = instantiate(cfg.method, model=model, optim=cfg.task.optim, scheduler=cfg.task.scheduler,
                         _recursive_=False)
    loggers = _instantiate_all(cfg.logger)
    callbacks = _instantiate_all(cfg.callbacks)
    if not loggers:  # logger=none: nothing to report learning rates to
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    timer = StepTimerCallback()
    trainer = build_trainer(cfg, out, loggers, [*callbacks, timer])
    start = time.time()
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.task.ckpt_path)
    wall = time.time() - start
    summary = {"wall_time_s": round(wall, 1), "global_step": trainer.global_step, "model": cfg.model.name,
               "method": cfg.method.name, "step_time_median_s": timer.median_s}
    summary.update({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})
    if trainer.is_global_zero:
        _collect_metrics(trainer, out)
        if cfg.task.export:
            module.patch.export(out / "export", tokenizer=tokenizer)
            summary["export"] = str(out / "export")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _collect_metrics(trainer: L.Trainer, out: Path) -> None:
    """Copy the CSV logger's metrics.csv to the run directory and plot the training loss."""
    from ..analysis.plots import loss_curve

    for logger in trainer.loggers:
        if isinstance(logger, L.pytorch.loggers.CSVLogger):
            src = Path(logger.log_dir) / "metrics.csv"
            if src.exists():
                if src.resolve() != (out / "metrics.csv").resolve():
                    shutil.copyfile(src, out / "metrics.csv")
                (out / "plots").mkdir(exist_ok=True)
                loss_curve(out / "metrics.csv", out / "plots" / "train_loss.png")
