"""Router-bias monitoring (Expert Condenser): per-layer bias statistics, histograms and a trajectory plot."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from ._dense import without_moe_layers
from ._logging import ends_training, log_metrics, logging_step, wandb_loggers

log = logging.getLogger("moe_lab.callbacks")

PLOT_NAME = "router_bias_trajectory.png"
CSV_NAME = "router_bias_trajectory.csv"


def bias_layers(pl_module: pl.LightningModule) -> list:
    """The MoE layer handles of ``pl_module.patch`` if every one has a router-bias buffer, else []."""
    patch = getattr(pl_module, "patch", None)
    layers = list(getattr(patch, "layers", None) or [])
    if layers and all(isinstance(getattr(layer, "bias", None), torch.Tensor) for layer in layers):
        return layers
    return []


def router_bias_metrics(layers) -> dict[str, float]:
    """``router_bias/layer{i}/{min,max,mean,norm}`` (norm: L2) per layer, and the same four over all
    layers' biases together: ``router_bias/{min,max,mean,norm}``."""
    flat = torch.cat([layer.bias.detach().float().reshape(-1) for layer in layers]).double().cpu()
    metrics: dict[str, float] = {}
    for layer, bias in zip(layers, torch.split(flat, [layer.bias.numel() for layer in layers])):
        metrics.update(_summary(bias, f"router_bias/layer{layer.index}/"))
    metrics.update(_summary(flat, "router_bias/"))
    return metrics


def _summary(values: torch.Tensor, prefix: str) -> dict[str, float]:
    stats = torch.stack([values.min(), values.max(), values.mean(), torch.linalg.vector_norm(values)])
    return dict(zip((f"{prefix}{name}" for name in ("min", "max", "mean", "norm")), stats.tolist()))


class RouterBiasCallback(Callback):
    """Log Expert Condenser's per-layer router biases and plot their trajectory.

    Active only when every MoE layer of ``pl_module.patch`` has a ``bias`` buffer (``method=condenser``);
    for other methods it logs and writes nothing. Biases are identical on every data-parallel rank (they
    are updated from all-reduced loads), so no collective is needed; rank zero writes.

    * Every ``log_every_n_steps`` optimizer steps (0: never): ``router_bias/layer{i}/min|max|mean|norm``
      (``norm``: L2) and ``router_bias/min|max|mean|norm`` over all layers' biases, on Lightning's step
      axis (the biases after optimizer step ``s`` at logging step ``s - 1``, like ``train/loss`` of that
      batch); with W&B also ``router_bias/layer{i}/histogram`` (the layer's bias values).
    * The trajectory: every layer's bias vector at the start of training, every ``record_every_n_steps``
      optimizer steps (None: ``log_every_n_steps``, or every step if that is 0), at the step the condensers
      were chosen and at the end, kept in memory (``float32``, layers x experts per record) and in the
      checkpoint: a resumed run continues the whole trajectory, with the condenser choice step. The end's
      record and plot come at the last optimizer step, before its checkpoint
      (:func:`~moe_lab.callbacks._logging.ends_training`).
    * Every ``plot_every_n_steps`` optimizer steps (0: only at the end) and at the end of training:
      ``router_bias_trajectory.png`` (one panel per layer, one line per expert, condensers in bold red, a
      dashed line at the choice step; :func:`moe_lab.analysis.bias_plots.bias_trajectory_plot`) and
      ``router_bias_trajectory.csv`` (:class:`moe_lab.analysis.bias_plots.BiasTrajectory`) in
      ``plot_dir`` (default ``<trainer.default_root_dir>/plots``), overwritten atomically; the PNG also
      goes to W&B as ``router_bias/trajectory``.

    ``self.latest`` holds the last logged metrics plus ``"step"``; ``self.trajectory()`` the recorded
    trajectory; ``self.chosen_at`` ``{layer index: optimizer step}`` of the condenser choice.
    """

    def __init__(
        self,
        log_every_n_steps: int = 10,
        record_every_n_steps: int | None = None,
        plot_every_n_steps: int = 250,
        plot_dir: str | os.PathLike | None = None,
    ):
        super().__init__()
        for name, value in (("log_every_n_steps", log_every_n_steps), ("plot_every_n_steps", plot_every_n_steps)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if record_every_n_steps is not None and record_every_n_steps < 1:
            raise ValueError(f"record_every_n_steps must be >= 1 or None, got {record_every_n_steps}")
        self.log_every_n_steps = int(log_every_n_steps)
        self.record_every_n_steps = int(record_every_n_steps or log_every_n_steps or 1)
        self.plot_every_n_steps = int(plot_every_n_steps)
        self.plot_dir = None if plot_dir is None else Path(plot_dir)
        self.latest: dict[str, Any] = {}
        self.chosen_at: dict[int, int] = {}
        self.condensers: dict[int, list[int]] = {}
        self.latest_plot: Path | None = None
        self._steps: list[int] = []
        self._records: list[torch.Tensor] = []
        self._layers: list = []
        self._restored = False
        self._trajectory: dict[str, Any] | None = None  # the trajectory of a checkpoint, until on_train_start
        self._last_seen_step: int | None = None
        self._final_step: int | None = None

    # state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {"chosen_at": dict(self.chosen_at), "condensers": {k: list(v) for k, v in self.condensers.items()}}
        if self._records:  # the trajectory so far (the same on every rank), continued by a resumed run
            state["trajectory"] = {"steps": list(self._steps), "biases": torch.stack(self._records)}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.chosen_at = {int(k): int(v) for k, v in state_dict.get("chosen_at", {}).items()}
        self.condensers = {int(k): list(v) for k, v in state_dict.get("condensers", {}).items()}
        self._trajectory = state_dict.get("trajectory")
        self._restored = True

    # hooks ------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._restored:
            self.chosen_at, self.condensers, self._trajectory = {}, {}, None
        self._restored = False
        self.latest, self.latest_plot, self._final_step = {}, None, None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._layers = [] if without_moe_layers(self, pl_module) else bias_layers(pl_module)
        self._steps, self._records = [], []
        self._last_seen_step = trainer.global_step
        trajectory, self._trajectory = self._trajectory, None
        if not self._layers:
            return
        if trajectory is not None and self._continue(trajectory, trainer.global_step):
            return  # the checkpoint's step is recorded in it if it is one of the recorded steps
        self._note_condensers(trainer.global_step)
        self._record(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not self._layers or step == self._last_seen_step:  # no biases, or an accumulating micro-batch
            return
        self._last_seen_step = step
        chosen_now = self._note_condensers(step)
        if chosen_now or step % self.record_every_n_steps == 0:
            self._record(step)
        if self.log_every_n_steps and step % self.log_every_n_steps == 0:
            self._log(trainer, pl_module, step)
        if ends_training(trainer):  # the end-of-training record and plot, before the last checkpoint (item 27)
            self._finish(trainer)
        elif self.plot_every_n_steps and step % self.plot_every_n_steps == 0:
            self._write(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._layers and self._final_step != trainer.global_step:
            self._finish(trainer)

    # work -------------------------------------------------------------------------------------
    def _finish(self, trainer: pl.Trainer) -> None:
        if self._steps[-1] != trainer.global_step:
            self._note_condensers(trainer.global_step)
            self._record(trainer.global_step)
        self._write(trainer, final=True)
        self._final_step = trainer.global_step

    def _continue(self, trajectory: dict[str, Any], step: int) -> bool:
        """Continue a checkpoint's trajectory (its records up to the resumed ``step``); False, with one log line,
        when it does not fit this model's biases."""
        biases, steps = trajectory["biases"], [int(s) for s in trajectory["steps"]]
        width = sum(layer.bias.numel() for layer in self._layers)
        if biases.dim() != 2 or biases.shape[1] != width or len(steps) != biases.shape[0]:
            log.warning("RouterBiasCallback: the checkpoint's bias trajectory has shape %s, this model's biases %d "
                        "values: the trajectory starts again at step %d", tuple(biases.shape), width, step)
            return False
        keep = [i for i, s in enumerate(steps) if s <= step]
        self._steps = [steps[i] for i in keep]
        self._records = [biases[i].float().cpu() for i in keep]
        return bool(self._records)

    def _note_condensers(self, step: int) -> bool:
        """Remember the step at which each layer's condensers appear; True if some appeared now."""
        new = False
        for layer in self._layers:
            ids = getattr(layer, "forced_expert_ids", None)
            if layer.index in self.chosen_at or ids is None or not ids.numel():
                continue
            forced = layer.forced_experts
            if forced:
                self.chosen_at[layer.index], self.condensers[layer.index] = step, list(forced)
                new = True
        return new

    def _record(self, step: int) -> None:
        flat = torch.cat([layer.bias.detach().float().reshape(-1) for layer in self._layers]).cpu()
        self._steps.append(step)
        self._records.append(flat)

    def trajectory(self):
        """The recorded biases as a :class:`~moe_lab.analysis.bias_plots.BiasTrajectory`."""
        from moe_lab.analysis.bias_plots import BiasTrajectory

        sizes = [layer.bias.numel() for layer in self._layers]
        stacked = torch.stack(self._records).numpy() if self._records else np.zeros((0, sum(sizes)), np.float32)
        columns = np.split(stacked, np.cumsum(sizes)[:-1], axis=1)
        return BiasTrajectory(
            steps=list(self._steps),
            biases={layer.index: col for layer, col in zip(self._layers, columns)},
            condensers={k: list(v) for k, v in self.condensers.items()},
            chosen_at=dict(self.chosen_at),
        )

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        metrics = router_bias_metrics(self._layers)
        self.latest = {**metrics, "step": step}
        extra = {}
        if trainer.is_global_zero and wandb_loggers(trainer):
            import wandb

            extra = {
                f"router_bias/layer{layer.index}/histogram": wandb.Histogram(
                    layer.bias.detach().float().cpu().numpy(), num_bins=min(64, layer.bias.numel())
                )
                for layer in self._layers
            }
        log_metrics(trainer, pl_module, metrics, logging_step(trainer), wandb_extra=extra)

    def _write(self, trainer: pl.Trainer, final: bool = False) -> Path | None:
        if not trainer.is_global_zero:
            return None
        from moe_lab.analysis.bias_plots import bias_trajectory_plot

        plot_dir = self.plot_dir if self.plot_dir is not None else Path(trainer.default_root_dir) / "plots"
        trajectory = self.trajectory()
        trajectory.to_csv(plot_dir / CSV_NAME)
        title = f"router bias trajectory, optimizer steps {trajectory.steps[0]}-{trajectory.steps[-1]}"
        path = bias_trajectory_plot(trajectory, plot_dir / PLOT_NAME, title=title + (" (end)" if final else ""))
        self.latest_plot = path
        for logger in wandb_loggers(trainer):
            logger.log_image(key="router_bias/trajectory", images=[str(path)], step=logging_step(trainer))
        return path
