"""Distillation metrics (method=kd): student-teacher KL, top-1 agreement, hidden MSE, per micro-batch."""

from __future__ import annotations

import lightning as L

NAMES = {"kl": "kd/kl", "div": "kd/divergence", "top1": "kd/top1_agreement", "hidden": "kd/hidden_mse",
         "ce": "kd/ce"}


class KDMetrics(L.Callback):
    """Logs ``pl_module.kd_stats`` (token means of the last micro-batch) under ``kd/...`` (train) and
    ``val/kd/...`` (validation, epoch means)."""

    def _log(self, pl_module, prefix: str, on_step: bool) -> None:
        for key, value in getattr(pl_module, "kd_stats", {}).items():
            pl_module.log(prefix + NAMES[key], value, on_step=on_step, on_epoch=not on_step,
                          sync_dist=not on_step, batch_size=1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._log(pl_module, "", True)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._log(pl_module, "val/", False)
