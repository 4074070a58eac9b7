"""The LightningModule of ``method=condenser`` (:mod:`moe_lab.methods.condenser` holds the method)."""

from __future__ import annotations

from pathlib import Path

from .base import MoELightningModule
from .condenser import STATE_FILE, save_condenser_state


class CondenserModule(MoELightningModule):
    """:class:`MoELightningModule` for Expert Condenser.

    * During a frozen (bias-only) warm-up the optimizer gets no gradients (they are dropped after the
      data-parallel all-reduce and after gradient-norm callbacks saw them), so every weight and the optimizer
      state stay bit-identical; the step still counts (global step, LR schedule, ``max_steps``). Refused
      under DeepSpeed, whose gradients live in its own buffers.
    * At the end of training, rank zero writes ``<run dir>/condenser.json`` (biases, usage, condensers, routing
      options): the ``bias_file`` of a later run (``task=condenser_two_phase`` reads it); all ranks wait for it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.patch.bias_updater is None:
            raise ValueError(f"CondenserModule needs method=condenser, got method={self.method!r}")

    def on_fit_start(self):
        super().on_fit_start()
        from lightning.pytorch.strategies import DeepSpeedStrategy

        if isinstance(self.trainer.strategy, DeepSpeedStrategy) and self.patch.bias_updater.freezes_weights:
            raise ValueError("method.options.warmup_trains_weights=false: DeepSpeed keeps the gradients in its own "
                             "buffers, so the bias-only warm-up cannot drop them; use task=condenser_two_phase "
                             "(condensers from a bias file, no warm-up) or warmup_trains_weights=true")

    def on_before_optimizer_step(self, optimizer):
        self.patch.bias_updater.before_optimizer_step(optimizer)

    def on_train_end(self):
        if self.trainer.is_global_zero:
            save_condenser_state(self.patch, Path(self.trainer.default_root_dir) / STATE_FILE)
        self.trainer.strategy.barrier("condenser_state")
