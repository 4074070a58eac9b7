"""W&B dashboard media beyond scalars: Lorenz curves and per-layer Gini of the expert load, the sweep summary as a
``wandb.Table``, the W&B group of a multirun job, and (opt-in) the export as a W&B artifact.

Everything here is W&B-only and rank-zero-only; the PNG heatmaps and bias trajectories are logged by their own
callbacks (``load/heatmap``, ``router_bias/trajectory``).
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from ._logging import wandb_loggers

log = logging.getLogger(__name__)

GINI_COLUMNS = ("layer", "gini", "tail_share", "tail_experts", "assignments")


def log_lorenz(loggers: Iterable, counts: Mapping[int, torch.Tensor], step: int, title: str,
               tau: float = 0.02) -> None:
    """Log ``load/lorenz`` (Lorenz curves per layer and pooled, with Gini;
    :func:`moe_lab.analysis.activation.distribution_figure`) and ``load/gini_by_layer`` (a table of per-layer
    Gini and tail share, :func:`moe_lab.analysis.activation.layer_stats`) for one window's ``{layer: counts}``.
    Layers without routed tokens are left out."""
    import wandb

    from moe_lab.analysis.activation import distribution_figure, layer_stats

    counts = {k: c for k, c in counts.items() if c.sum() > 0}
    loggers = list(loggers)
    if not counts or not loggers:
        return
    rows, summary = layer_stats(counts, tau)
    with tempfile.TemporaryDirectory() as tmp:
        path = distribution_figure(counts, Path(tmp) / "lorenz.png", title, summary)
        for logger in loggers:  # wandb copies the PNG into the run's media folder at log time
            table = wandb.Table(columns=list(GINI_COLUMNS), data=[[r[c] for c in GINI_COLUMNS] for r in rows])
            logger.log_metrics({"load/lorenz": wandb.Image(str(path)), "load/gini_by_layer": table}, step=step)


def sweep_group(default: str | None) -> str | None:
    """W&B group of a job: the sweep directory's name in a Hydra multirun (all jobs of one sweep together, beside
    the sweep's summary table), ``default`` otherwise. The sweep-summary Hydra callback puts it in
    ``WANDB_RUN_GROUP``, which conf/logger/wandb.yaml reads (``${oc.env:WANDB_RUN_GROUP,${task.name}}``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(str(HydraConfig.get().sweep.dir)).name
    return default


def log_sweep_table(sweep_dir: str | Path, rows: list[dict], columns: Iterable[str], wandb_cfg: Mapping[str, Any]):
    """A W&B run ``<sweep dir name>/summary`` in group ``<sweep dir name>`` holding ``sweep/summary``: the sweep
    table (one row per job) as a ``wandb.Table``; ``wandb_cfg`` is the logger node (project, entity). Returns the
    finished run's directory."""
    import wandb

    group = Path(sweep_dir).name
    columns = list(columns)
    run = wandb.init(project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"), group=group,
                     name=f"{group}/summary", job_type="sweep_summary", dir=str(sweep_dir), reinit="create_new")
    try:
        table = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows],
                            allow_mixed_types=True)
        run.log({"sweep/summary": table})
        return Path(run.dir).parent
    finally:
        run.finish()


class WandbMediaCallback(Callback):
    """``log_export=True``: the export directory (merged model, and the PEFT adapter with method.lora) becomes the
    W&B artifact ``<run name>-export`` (type ``model``) of the run. No-op without a W&B logger."""

    def __init__(self, log_export: bool = False):
        super().__init__()
        self.log_export = bool(log_export)
        self._hooked = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        patch = getattr(pl_module, "patch", None)
        if not self.log_export or self._hooked or patch is None or not trainer.is_global_zero:
            return
        loggers = wandb_loggers(trainer)
        if loggers and getattr(patch, "export_hooks", None) is None:
            log.info("%s has no export hooks: WandbMediaCallback cannot upload the export", type(patch).__name__)
        elif loggers:
            patch.export_hooks.append(functools.partial(self._log_artifact, loggers))  # picklable
            self._hooked = True

    @staticmethod
    def _log_artifact(loggers, path) -> None:
        import wandb

        for logger in loggers:
            run = logger.experiment
            artifact = wandb.Artifact(f"{run.name or run.id}-export".replace("/", "-"), type="model")
            artifact.add_dir(str(path))  # copied into W&B's staging area now: the directory is renamed after
            run.log_artifact(artifact)
