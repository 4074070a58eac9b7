"""Expert-load monitoring: per-layer routing balance metrics, W&B histograms and heatmap PNGs."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from moe_lab.analysis.load_stats import load_summary

from ._dense import without_moe_layers
from ._logging import ends_training, log_metrics, logging_step, wandb_loggers
from ._windows import CountWindow, log
from .wandb_media import log_lorenz


class ExpertLoadCallback(Callback):
    """Log how evenly each MoE layer spreads its tokens over its experts.

    Counts come from each layer's monotonic ``total_counts`` buffer (tokens routed in training mode, pad
    tokens excluded), read as deltas since this callback's previous read, so other code resetting
    ``counts`` does not interfere. The per-rank deltas are summed over all ranks
    (``trainer.strategy.reduce(..., "sum")``, a no-op in a single process), so every rank logs the
    statistics of the global batch; the reduction is a collective, all ranks call it at the same steps.

    Every ``log_every_n_steps`` optimizer steps (``trainer.global_step % n == 0``, checked once per
    optimizer step, so gradient accumulation is handled) it logs over the window since its last log:

    * ``load/layer{idx}/imbalance`` (max / mean load), ``load/layer{idx}/gini``,
      ``load/layer{idx}/entropy`` (nats) and ``load/layer{idx}/entropy_norm`` (entropy / log E);
    * ``load/imbalance_mean``, ``load/gini_mean``, ``load/entropy_norm_mean`` over layers;

    written once to every attached logger on rank zero (see :mod:`moe_lab.callbacks._logging` for why
    not through Lightning's ``log_dict`` flush, which would repeat stale values or drop them depending on
    ``trainer.log_every_n_steps``) and mirrored into ``trainer.callback_metrics`` with
    ``pl_module.log_dict(on_step=True, on_epoch=False, sync_dist=False, logger=False)``. The logger step
    is Lightning's own (``train/loss`` of the same batch has the same step: ``global_step - 1``).

    With a :class:`~lightning.pytorch.loggers.WandbLogger` attached, rank zero also logs
    ``load/layer{idx}/histogram``: a ``wandb.Histogram`` with one bin per expert whose height is the
    expert's share of the layer's load.

    Every ``heatmap_every_n_steps`` optimizer steps and at the end of training it writes a layer x expert
    heatmap of the load since the previous heatmap (every snapshot on one colour scale, ``colour_scale``) to ``plot_dir`` (default
    ``<trainer.default_root_dir>/plots``) as ``expert_load_step{step:06d}.png`` and
    ``expert_load_latest.png`` (rank zero only), and logs it to W&B as ``load/heatmap`` (one image per
    snapshot on the step axis), with ``load/lorenz`` and ``load/gini_by_layer`` of the same window
    (:func:`~moe_lab.callbacks.wandb_media.log_lorenz`). ``0`` disables
    the heatmaps (or the metrics, for ``log_every_n_steps``).

    Across a resume both windows continue: the counts of their steps before the checkpoint, summed over ranks,
    are in the checkpoint (:mod:`moe_lab.callbacks._windows`), so a resumed run logs and plots what an
    uninterrupted one does. The end-of-training heatmap is written at the last optimizer step, before its
    checkpoint (:func:`~moe_lab.callbacks._logging.ends_training`).

    ``self.latest`` holds the last logged metrics (floats) plus ``"step"`` and ``"counts"`` (the reduced
    int64 ``[L, E]`` window counts); ``self.latest_heatmap`` the path of the last heatmap written.
    W&B entries go through ``WandbLogger.log_metrics``/``log_image``, i.e. on Lightning's
    ``trainer/global_step`` axis, not ``wandb.log(step=...)``: the logger never passes ``step=`` to W&B, so
    W&B's implicit step runs ahead of the optimizer step and an explicit one would be rejected as
    non-monotonic.
    """

    def __init__(
        self,
        log_every_n_steps: int = 10,
        heatmap_every_n_steps: int = 50,
        plot_dir: str | os.PathLike | None = None,
    ):
        super().__init__()
        if log_every_n_steps < 0 or heatmap_every_n_steps < 0:
            raise ValueError("log_every_n_steps and heatmap_every_n_steps must be >= 0")
        self.log_every_n_steps = int(log_every_n_steps)
        self.heatmap_every_n_steps = int(heatmap_every_n_steps)
        self.plot_dir = None if plot_dir is None else Path(plot_dir)
        self.latest: dict[str, Any] = {}
        self.latest_heatmap: Path | None = None
        self._log_window: CountWindow | None = None  # None: a dense model (nothing counted)
        self._heat_window: CountWindow | None = None
        self._restored: dict[str, Any] | None = None
        self._last_seen_step: int | None = None
        self._final_step: int | None = None

    # helpers ------------------------------------------------------------------------------
    @staticmethod
    def _layers(pl_module: pl.LightningModule):
        patch = getattr(pl_module, "patch", None)
        if patch is None:
            raise AttributeError(
                "ExpertLoadCallback needs the LightningModule to expose the MoEPatch as `self.patch`"
            )
        return patch.layers

    def _totals(self, pl_module: pl.LightningModule) -> torch.Tensor:
        """Flat int64 copy of every layer's ``total_counts`` (layers may differ in expert count)."""
        return torch.cat(
            [layer.total_counts.detach().reshape(-1) for layer in self._layers(pl_module)]
        ).clone()

    def _split(self, pl_module, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(flat, [layer.num_experts for layer in self._layers(pl_module)]))

    def _resolve_plot_dir(self, trainer: pl.Trainer) -> Path:
        return self.plot_dir if self.plot_dir is not None else Path(trainer.default_root_dir) / "plots"

    @staticmethod
    def colour_scale(layers, fractions: torch.Tensor) -> float:
        """One colour-scale maximum for every snapshot of a run, so heatmaps compare: ``1 / top_k``, the largest
        share an expert can take when each token's ``top_k`` slots go to distinct experts (a larger observed
        share, from a method that routes fewer slots per token, widens it)."""
        top_k = min(int(layer.top_k) for layer in layers)
        observed = float(torch.nan_to_num(fractions, nan=0.0).max()) if fractions.numel() else 0.0
        return max(1.0 / top_k, observed)

    # state --------------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint) -> None:
        """The open windows (their start and all ranks' counts so far) go into the checkpoint, so the first log
        and heatmap after a resume cover the same steps as in an uninterrupted run (a collective: every rank
        writes a checkpoint together)."""
        if self._log_window is None or self._heat_window is None:
            return
        totals = self._totals(pl_module)
        checkpoint.setdefault("callbacks", {})[self.state_key] = {
            "log": self._log_window.state(trainer, totals), "heatmap": self._heat_window.state(trainer, totals)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict) if state_dict else None

    # hooks --------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._final_step = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored, self._restored = self._restored, None
        if without_moe_layers(self, pl_module):  # a dense model: nothing to count
            self._log_window = self._heat_window = None
            return
        totals, step = self._totals(pl_module), trainer.global_step
        self._log_window, self._heat_window = CountWindow(), CountWindow()
        if restored is None:
            if step:
                log.info("ExpertLoadCallback: the checkpoint holds no load window (an older moe-lab, or a run "
                         "without this callback): the first load/* values and heatmap after the resume cover the "
                         "steps from %d only", step)
            self._log_window.open(totals, step)
            self._heat_window.open(totals.clone(), step)
        else:
            self._log_window.resume(totals, step, restored.get("log"), "ExpertLoadCallback load/*")
            self._heat_window.resume(totals.clone(), step, restored.get("heatmap"), "ExpertLoadCallback heatmap")
        self._last_seen_step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._log_window is None or step == self._last_seen_step:  # dense model, or accumulating micro-batch
            return
        self._last_seen_step = step
        if self.log_every_n_steps and step % self.log_every_n_steps == 0:
            self._log_stats(trainer, pl_module, step)
        if self.heatmap_every_n_steps and step % self.heatmap_every_n_steps == 0:
            self._heatmap(trainer, pl_module, step)
        elif self.heatmap_every_n_steps and ends_training(trainer):  # before the last checkpoint (item 27)
            self._heatmap(trainer, pl_module, step, final=True)
        if ends_training(trainer):
            self._final_step = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.heatmap_every_n_steps and self._heat_window is not None and self._final_step != trainer.global_step:
            self._heatmap(trainer, pl_module, trainer.global_step, final=True)

    # work ---------------------------------------------------------------------------------
    def _log_stats(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        assert self._log_window is not None
        _, flat = self._log_window.close(trainer, self._totals(pl_module), step)
        layers = self._layers(pl_module)
        metrics: dict[str, float] = {}
        histograms: dict[str, torch.Tensor] = {}
        per_layer: dict[str, list[float]] = {"imbalance": [], "gini": [], "entropy_norm": []}
        for layer, counts in zip(layers, self._split(pl_module, flat)):
            stats = load_summary(counts)
            for name in ("imbalance", "gini", "entropy", "entropy_norm"):
                metrics[f"load/layer{layer.index}/{name}"] = float(stats[name])
            for name, values in per_layer.items():
                values.append(float(stats[name]))
            if counts.sum() > 0:
                histograms[f"load/layer{layer.index}/histogram"] = stats["fractions"]
        for name, values in per_layer.items():
            finite = [v for v in values if not math.isnan(v)]
            metrics[f"load/{name}_mean"] = sum(finite) / len(finite) if finite else math.nan
        if len(layers) and all(layer.num_experts == layers[0].num_experts for layer in layers):
            counts = flat.reshape(len(layers), -1)
        else:
            counts = self._split(pl_module, flat)
        self.latest = {**metrics, "step": step, "counts": counts}
        extra = {}
        if histograms and trainer.is_global_zero and wandb_loggers(trainer):
            import wandb

            extra = {
                key: wandb.Histogram(np_histogram=(frac.numpy(), list(range(len(frac) + 1))))
                for key, frac in histograms.items()
            }
        log_metrics(trainer, pl_module, metrics, logging_step(trainer), wandb_extra=extra)

    def _heatmap(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, final: bool = False):
        assert self._heat_window is not None
        start, flat = self._heat_window.close(trainer, self._totals(pl_module), step)
        if flat.sum() == 0:  # nothing routed since the last heatmap (e.g. train end right after one)
            return None
        if not trainer.is_global_zero:
            return None
        from moe_lab.analysis.plots import expert_load_heatmap

        layers = self._layers(pl_module)
        summaries = [load_summary(c)["fractions"] for c in self._split(pl_module, flat)]
        width = max(len(f) for f in summaries)
        fractions = torch.full((len(summaries), width), math.nan, dtype=torch.float64)
        for row, frac in enumerate(summaries):
            fractions[row, : len(frac)] = frac
        plot_dir = self._resolve_plot_dir(trainer)
        path = plot_dir / f"expert_load_step{step:06d}.png"
        title = f"expert load, optimizer steps {start + 1}-{step}" + (" (end of training)" if final else "")
        expert_load_heatmap(fractions, [layer.index for layer in layers], path, title=title,
                            vmax=self.colour_scale(layers, fractions))
        latest = plot_dir / "expert_load_latest.png"
        tmp = plot_dir / ".expert_load_latest.png.tmp"
        tmp.write_bytes(path.read_bytes())
        os.replace(tmp, latest)
        self.latest_heatmap = path
        for logger in wandb_loggers(trainer):
            logger.log_image(key="load/heatmap", images=[str(path)], step=logging_step(trainer))
        log_lorenz(wandb_loggers(trainer), {layer.index: c for layer, c in zip(layers, self._split(pl_module, flat))},
                   logging_step(trainer), title.replace("expert load", "expert load Lorenz curves"))
        return path
