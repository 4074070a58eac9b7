"""Train an MoE model with one method under the run-time layer (run lock, resume checks, signals, SLURM
requeue), then export a vanilla-loadable checkpoint: the run behind task=finetune and the training stages of
multi-stage tasks."""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import warnings
from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from ..callbacks.progress import ProgressLog
from ..callbacks.step_timer import StepTimerCallback
from ..core.atomic import atomic_write_json
from ..core.method_class import module_fact
from ..core.precision import export_in_load_dtype
from ..models import load_model
from ..runtime import slurm
from ..runtime.checkpoint_io import (
    CheckpointOnSignal,
    check_matches,
    check_resumable,
    read_checkpoint,
)
from ..runtime.expert_parallel import ep_dense, ep_size
from ..runtime.resume import (
    History,
    LastStepCheckpoint,
    accept_run,
    check_changes,
    check_progress,
    check_trainable,
    other_parameters,
    pin_wandb_run,
    refuse_existing_run,
    resume_checkpoint,
    run_record,
)
from ..runtime.run_lock import RunLock
from ..runtime.stop_signal import RunInterrupted
from ..runtime.strategies import config_strategy_kind, gather_full_weights, prepare
from ..runtime.trainer import build_trainer, instantiate_all
from .checks import refuse_before_first_step

log = logging.getLogger(__name__)


class _RunInfo(L.Callback):
    """Stores the model and method in every checkpoint (so a mismatched resume names both) and puts the whole
    resolved config into W&B once Lightning has logged the module's hyperparameters."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        checkpoint["moe_lab"] = {"model": self.cfg.model.name, "method": self.cfg.method.name,
                                 "run": run_record(self.cfg, trainer.world_size)}  # what a resume compares

    def on_train_start(self, trainer, pl_module) -> None:
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and trainer.is_global_zero:
                logger.experiment.config.update(OmegaConf.to_container(self.cfg, resolve=True),
                                                allow_val_change=True)


def _loggers(cfg: DictConfig, out: Path, history: History) -> list:
    pin_wandb_run(cfg, history, out)
    with warnings.catch_warnings():  # the run directory holds config.yaml already; metrics.csv is handled here
        warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
        loggers = instantiate_all(cfg.logger)
        for logger in loggers:
            if isinstance(logger, L.pytorch.loggers.CSVLogger):
                logger.experiment  # noqa: B018 - create the writer now (it deletes an old metrics.csv)
    history.replay(loggers)
    return loggers


def finetune(cfg: DictConfig) -> dict:
    """Train ``cfg.model`` with ``cfg.method`` on ``cfg.dataset``; write metrics, plots and ``export/``. The run
    directory is locked for the run (a second run into it is refused, :class:`~.run_lock.RunLock`)."""
    with RunLock(cfg.paths.output_dir):  # held already under run_task; taken here for a chained task's phases
        return _finetune(cfg)


def _finetune(cfg: DictConfig) -> dict:
    out = Path(cfg.paths.output_dir)
    say_eval_not_run(cfg, out)
    slurm.resume_requeued(cfg)  # a requeued SLURM job continues its own last.ckpt
    ckpt_path, field = resume_checkpoint(cfg)
    if ckpt_path is None:
        refuse_existing_run(cfg, out)  # the same command again would start that run over
    else:
        check_resumable(ckpt_path, field, config_strategy_kind(cfg.hardware.trainer),
                        adopt=bool(cfg.task.get("adopt_checkpoint")))
    ckpt = read_checkpoint(ckpt_path, field) if ckpt_path is not None else None
    recorded = None
    if ckpt is not None:
        check_progress(ckpt, cfg, field)  # a resume that would train nothing is refused or said
        recorded = check_changes(ckpt, ckpt_path, cfg, field)  # dataset, method, batch size, world size, ...
    resumed_step = int(ckpt["global_step"]) if ckpt is not None else 0
    L.seed_everything(cfg.seed, workers=True)
    model, tokenizer = load_model(cfg.model, method=cfg.method.get("name"),
                                  dense=module_fact(cfg.method, "trains_dense_models", False))
    datamodule = instantiate(cfg.dataset, tokenizer=tokenizer)
    module = instantiate(cfg.method, model=model, optim=cfg.task.optim, scheduler=cfg.task.scheduler,
                         _recursive_=False)
    refuse_before_first_step(cfg, module)  # what plan=true refuses too, from the same function
    if ckpt is not None:
        check_matches(ckpt, ckpt_path, module, f"{cfg.model.name} / {cfg.method.name}", field)
        check_trainable(ckpt, ckpt_path, module, cfg, field, recorded)
        del ckpt
    accept_run()  # run.py's config.yaml and .hydra/, held back until a resume is accepted
    history = History(ckpt_path, resumed_step, out)
    loggers = _loggers(cfg, out, history)
    callbacks = instantiate_all(cfg.callbacks)
    if not loggers:  # logger=none: nothing to report learning rates to
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    clock = next((c for c in callbacks if isinstance(c, ProgressLog)), None)
    if clock is None:  # callbacks=none: still keep the wall time across resumes
        clock = ProgressLog(quiet=True)
        callbacks.append(clock)
    timer, on_signal = StepTimerCallback(), CheckpointOnSignal(out / "checkpoints" / "last.ckpt")
    requeue = slurm.SubmititRequeue()
    trainer = build_trainer(cfg, out, loggers, [*callbacks, timer, on_signal, _RunInfo(cfg), LastStepCheckpoint()])
    prepare(trainer, module, ep_size(cfg), ep_dense(cfg))
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    except SIGTERMException:
        if on_signal.saved is None:
            raise
    except SystemExit:  # Lightning's exit(1) after the KeyboardInterrupt of a second Ctrl-C
        if on_signal.signum is None or on_signal.saved is not None:
            raise
        print("second Ctrl-C: stopped without writing a new checkpoint", file=sys.stderr, flush=True)
        raise RunInterrupted(128 + int(signal.SIGINT)) from None
    except ValueError as err:  # torch's optimizer-state error when an allowed method change trains other parameters
        if ckpt_path is None or "parameter group" not in str(err):
            raise
        raise other_parameters(field, ckpt_path, cfg.method.name, recorded) from None
    interrupted = on_signal.saved is not None
    summary = {"wall_time_s": round(clock.wall_time_s, 1), "wall_time_this_run_s": round(clock.this_run_s, 1),
               "global_step": trainer.global_step, "resumed_from_step": resumed_step or None,
               "model": cfg.model.name, "method": cfg.method.name, "step_time_median_s": timer.median_s,
               "interrupted": interrupted}
    summary.update({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})
    # a resumed run that has not validated since: its last validation's metrics, as the uninterrupted run reports
    summary.update({k: v for k, v in _last_values(history.rows, "val/").items() if k not in summary})
    summary["data"] = _data_counts(datamodule)
    gather_full_weights(trainer, module)  # ZeRO-3 / FSDP: whole tensors on rank zero for the export
    if trainer.is_global_zero:
        summary["plots"] = _collect_metrics(trainer, out, log_scale=bool(cfg.task.get("loss_log_scale", False)))
        if cfg.task.export and not interrupted:
            export_in_load_dtype(module.patch)  # fp32 master weights are written in the load dtype
            module.patch.export(out / "export", tokenizer=tokenizer)
            summary["export"] = str(out / "export")
        atomic_write_json(out / "summary.json", summary)
        print(summary_block(summary, out), flush=True)
    if interrupted:
        requeue(on_signal.signum)  # in a submitit SLURM job, SIGUSR1/2: submitit requeues and exits
        raise RunInterrupted(128 + int(on_signal.signum or signal.SIGINT))
    return summary


def say_eval_not_run(cfg: DictConfig, out: Path) -> None:
    """``eval=<group>`` on a training run: task=finetune trains and exports; it does not evaluate. One line says so
    and gives the command that evaluates this run's export (an eval group is otherwise silently unused)."""
    if cfg.get("eval") is None or cfg.task.name != "finetune":
        return
    limit = "" if cfg.eval.get("limit") is None else f" eval.limit={cfg.eval.limit}"
    log.warning("eval=%s: task=finetune trains and exports, it does not evaluate; evaluate this run's export with: "
                "python run.py task=evaluate eval=%s%s model=%s task.checkpoint=%s", cfg.eval.get("name"),
                cfg.eval.get("name"), limit, cfg.model.name, out / "export")


def _last_values(rows: list[dict], prefix: str) -> dict:
    """The last value logged of each metric named ``prefix...`` in metrics.csv ``rows``."""
    return {k: float(v) for row in rows for k, v in row.items() if k.startswith(prefix)}


def _data_counts(datamodule) -> dict:
    """Examples kept / truncated / dropped per split (what the overflow policy did to the data)."""
    counts = getattr(datamodule, "overflow_counts", None) or {}
    return {split: {"kept": c["kept"], "truncated": c["truncated"], "dropped": c["too_long"] + c["no_labels"]}
            for split, c in counts.items()}


def _collect_metrics(trainer: L.Trainer, out: Path, log_scale: bool = False) -> list[str]:
    """Copy the CSV logger's metrics.csv to the run directory and plot the loss; returns the plots written.

    Plotting never costs the export: with no loss logged yet the curve is skipped with a note.
    """
    from ..analysis.plots import loss_curve

    for logger in trainer.loggers:
        if isinstance(logger, L.pytorch.loggers.CSVLogger):
            src = Path(logger.log_dir) / "metrics.csv"
            if src.exists() and src.resolve() != (out / "metrics.csv").resolve():
                shutil.copyfile(src, out / "metrics.csv")
    plots = out / "plots"
    if (out / "metrics.csv").exists():
        try:
            loss_curve(out / "metrics.csv", plots / "train_loss.png", log_scale=log_scale)
        except ValueError as err:
            log.warning("plots/train_loss.png skipped: %s", err)
        except Exception as err:  # noqa: BLE001 - a plotting failure is reported, the run's results are still written
            log.warning("plots/train_loss.png failed (%s: %s); the run's other outputs are written", type(err).__name__,
                        err)
    return sorted(p.name for p in plots.glob("*.png")) if plots.is_dir() else []


def _fmt(value, digits=4) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def summary_block(summary: dict, out: Path) -> str:
    """The end-of-run block a person reads: losses, steps, wall time, data and where everything is."""
    steps = str(summary["global_step"])
    if summary.get("resumed_from_step"):
        steps += f" (resumed at step {summary['resumed_from_step']})"
    wall = f"{summary['wall_time_s']:.1f} s"
    if summary.get("resumed_from_step"):
        wall += f" in total, {summary['wall_time_this_run_s']:.1f} s in this run"
    lines = [
        ("model / method", f"{summary['model']} / {summary['method']}"),
        ("steps", steps),
        ("train/loss", _fmt(summary.get("train/loss"))),
        ("val/loss", _fmt(summary.get("val/loss"))),
        ("wall time", wall),
    ]
    for split, c in summary.get("data", {}).items():
        used = f"{c['kept'] + c['truncated']} used ({c['kept']} whole, {c['truncated']} truncated)"
        lines.append((f"{split} examples", f"{used}, {c['dropped']} dropped"))
    lines.append(("run directory", str(out)))
    lines.append(("export", summary.get("export") or ("not written (interrupted)" if summary["interrupted"]
                                                      else "off (task.export=false)")))
    plots = summary.get("plots") or []
    lines.append(("plots", f"{out / 'plots'}: {', '.join(plots)}" if plots else "none"))
    width = max(len(k) for k, _ in lines)
    title = "run interrupted, checkpoint written" if summary["interrupted"] else "run finished"
    return "\n".join([f"==== moe-lab finetune: {title} ===="]
                     + [f"  {k.ljust(width)}  {v}" for k, v in lines])
