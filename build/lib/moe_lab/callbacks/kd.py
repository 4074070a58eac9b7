"""Distillation metrics (method=kd): student-teacher KL, top-1 agreement, hidden MSE, per micro-batch; and the
logit-lens KL per layer-group (``KDLayerKL``).

Reading of the issue's "student-teacher KL per layer-group": the decoder layers of both models are cut into
``layer_groups`` equal groups; at the end of each group each model's final norm + lm_head turn its hidden states
into next-token distributions, and ``kd/kl_group_<i>`` (i = 0 first group) is the forward KL(p_T || p_S) at
tau = 1, mean over the real tokens of the current training batch (``moe_lab.distill.layer_kl``). The last group
is the models' real outputs. Only for a live teacher with the student's layer count (otherwise one log line).
"""

from __future__ import annotations

import contextlib
import logging

import lightning as L

from ..data.packing import model_inputs, real_token_mask
from ..distill.layer_kl import layer_group_kl
from ._logging import log_metrics, logging_step

log = logging.getLogger(__name__)

NAMES = {"kl": "kd/kl", "div": "kd/divergence", "top1": "kd/top1_agreement", "hidden": "kd/hidden_mse",
         "hidden_weight": "kd/hidden_weight", "ce": "kd/ce"}


class KDLayerKL(L.Callback):
    """Logs ``kd/kl_group_<i>`` every ``every_n_steps`` optimizer steps on the current training batch (eval
    mode, no gradients, the trainer's precision context; training flags restored). Configure it as
    ``+callbacks.kd._target_=moe_lab.callbacks.kd.KDLayerKL +callbacks.kd.layer_groups=...``; without it
    ``KDMetrics`` (added by method=kd) logs it with the defaults."""

    def __init__(self, layer_groups: int = 4, every_n_steps: int = 50, chunk_size: int = 1024):
        if int(layer_groups) < 1 or int(every_n_steps) < 1:
            raise ValueError(f"callbacks.kd: layer_groups={layer_groups} and every_n_steps={every_n_steps} "
                             "must be >= 1")
        self.layer_groups, self.every_n_steps, self.chunk_size = int(layer_groups), int(every_n_steps), chunk_size
        self._last_seen_step = 0
        self._skip: str | None = None

    def _why_skip(self, pl_module) -> str | None:
        teacher = getattr(pl_module, "teacher", None)
        if teacher is None:
            return "no live teacher (method=kd with method.options.teacher_logits, or another method)"
        ls, lt = len(pl_module.model.base_model.layers), len(teacher.base_model.layers)
        if ls != lt:
            return f"student has {ls} decoder layers, teacher {lt}"
        return None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_seen_step:  # accumulating micro-batch, or no optimizer step yet
            return
        self._last_seen_step = step
        if step % self.every_n_steps:
            return
        if self._skip is None:
            self._skip = self._why_skip(pl_module) or ""
            if self._skip:
                log.info("kd/kl_group_* not logged: %s", self._skip)
        if self._skip:
            return
        log_metrics(trainer, pl_module, self.measure(trainer, pl_module, batch), logging_step(trainer))

    def measure(self, trainer, pl_module, batch) -> dict[str, float]:
        """``{"kd/kl_group_<i>": value}`` on ``batch`` with the models as they are now."""
        inputs = model_inputs({"labels": None, **batch})
        inputs.pop("labels")
        student, teacher = pl_module.model, pl_module.teacher
        flags = [(m, m.training) for m in student.modules()]
        context = trainer.precision_plugin.val_step_context if trainer is not None else contextlib.nullcontext
        try:
            student.eval()
            with context():
                values = layer_group_kl(student, teacher, {**inputs, "use_cache": False}, real_token_mask(batch),
                                        self.layer_groups, self.chunk_size)
        finally:
            for module, flag in flags:
                module.training = flag
        return {f"kd/kl_group_{i}": v for i, v in enumerate(values)}


class KDMetrics(L.Callback):
    """Logs ``pl_module.kd_stats`` (token means of the last micro-batch) under ``kd/...`` (train) and
    ``val/kd/...`` (validation, epoch means); and the layer-group KL with ``KDLayerKL``'s defaults unless the
    trainer has its own ``KDLayerKL`` (``callbacks.kd``)."""

    def __init__(self):
        self.layer_kl: KDLayerKL | None = KDLayerKL()

    def setup(self, trainer, pl_module, stage) -> None:
        if any(isinstance(c, KDLayerKL) for c in trainer.callbacks):
            self.layer_kl = None

    def _log(self, pl_module, prefix: str, on_step: bool) -> None:
        for key, value in getattr(pl_module, "kd_stats", {}).items():
            pl_module.log(prefix + NAMES[key], value, on_step=on_step, on_epoch=not on_step,
                          sync_dist=not on_step, batch_size=1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._log(pl_module, "", True)
        if self.layer_kl is not None:
            self.layer_kl.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._log(pl_module, "val/", False)
