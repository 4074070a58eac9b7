"""The LightningModule of ``method=condenser`` (:mod:`moe_lab.methods.condenser` holds the method)."""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from ..callbacks._logging import ends_training
from ..data.packing import model_inputs, real_token_mask
from ..runtime.refusals import check_in_run_choice
from .base import MoELightningModule
from .condenser import (
    STATE_FILE,
    condenser_summary,
    run_selection_phase,
    save_condenser_state,
    selection_tokens,
)

log = logging.getLogger(__name__)


class CondenserModule(MoELightningModule):
    """:class:`MoELightningModule` for Expert Condenser.

    * Fit start: ``selection=in_run`` whose condensers would be chosen at or after the run's last optimizer
      step (``trainer.estimated_stepping_batches``; epochs included) is refused, naming the numbers. Under
      ``selection=pre_phase`` (default) the forward-only pre-phase (:func:`run_selection_phase`) runs over the
      first training micro-batches through the strategy's wrapped model (DDP, DeepSpeed ZeRO-2/3 and FSDP
      alike; no gradients, so no optimizer, LR-schedule or global step is consumed; the global RNG and the
      loader's position are restored). At train start one line (rank zero) says when and how the condensers
      are chosen and on how many tokens.
    * ``update_every=micro_batch`` (the public code): one bias update after every training micro-batch's backward,
      before the optimizer step it may end, hence inside that step's checkpoint.
    * At the end of training, rank zero writes ``<run dir>/condenser.json`` (biases, usage, condensers, routing
      options): the ``bias_file`` of a later run (``task=condenser_two_phase`` reads it); all ranks wait for it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.patch.bias_updater is None:
            raise ValueError(f"CondenserModule needs method=condenser, got method={self.method!r}")
        self.selection_report: dict | None = None

    # fit start --------------------------------------------------------------------------------
    def on_fit_start(self):
        super().on_fit_start()
        updater = self.patch.bias_updater
        if updater.pending and updater.selection == "in_run":
            self._check_in_run_choice()
        if updater.pending and updater.selection == "pre_phase" and self.trainer.ckpt_path is None:
            self.selection_report = self._pre_phase()

    def on_train_start(self):
        """After a resume's checkpoint is restored (DeepSpeed restores after fit start): the start line."""
        updater = self.patch.bias_updater
        if updater.pending and updater.selection == "pre_phase":
            raise ValueError(f"condenser selection=pre_phase: resumed at optimizer step {self.trainer.global_step} "
                             "from a checkpoint without condensers; resume from a checkpoint of a method=condenser "
                             "run with selection=pre_phase, or start a new run")
        if self.trainer.is_global_zero:
            log.info(self.selection_line())

    def _updates_in_run(self) -> tuple[float, str]:
        """(bias updates this run makes, how that number follows from the trainer)."""
        trainer = self.trainer
        steps = trainer.estimated_stepping_batches
        how = (f"trainer.estimated_stepping_batches={steps} optimizer steps from max_steps={trainer.max_steps}, "
               f"max_epochs={trainer.max_epochs}, {trainer.num_training_batches} micro-batches per epoch, "
               f"accumulate_grad_batches={trainer.accumulate_grad_batches}")
        if self.patch.bias_updater.update_every == "micro_batch":
            return steps * trainer.accumulate_grad_batches, f"one per micro-batch: {how}"
        return steps, f"one per optimizer step: {how}"

    def _check_in_run_choice(self) -> None:
        total, how = self._updates_in_run()
        if not math.isfinite(total):
            log.warning("condenser: selection=in_run chooses the condensers after %d bias updates, and this run's "
                        "length is unknown (%s): they are chosen only if it runs that long",
                        self.patch.bias_updater.selection_updates, how)
        check_in_run_choice(self.patch.bias_updater, self.trainer.estimated_stepping_batches,
                            self.trainer.accumulate_grad_batches)

    # the pre-phase ----------------------------------------------------------------------------
    def _pre_phase(self) -> dict:
        trainer = self.trainer
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()
        loader = trainer.train_dataloader
        if isinstance(loader, (list, tuple, dict)):
            raise TypeError("condenser selection=pre_phase reads one training dataloader; this run has "
                             f"{len(loader)}: give one, or use selection=in_run / bias_file=")
        position = loader.state_dict() if hasattr(loader, "state_dict") else None
        if trainer.is_global_zero:
            updater = self.patch.bias_updater
            per_update = 1 if updater.update_every == "micro_batch" else trainer.accumulate_grad_batches
            log.info("condenser: choosing the condensers before step 0: a forward-only pre-phase of %d bias updates "
                     "x %d micro-batch(es) per rank", updater.selection_updates, per_update)
        was_training = self.model.training
        self.model.train()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):  # dropout / jitter / shuffling draw nothing from training
                report = run_selection_phase(self.patch, _cycle(loader), self._selection_forward,
                                             trainer.accumulate_grad_batches)
        finally:
            self.model.train(was_training)
            if position is not None:
                loader.load_state_dict(position)
        per_rank = report["micro_batches"] / trainer.world_size
        report["passes"] = per_rank / len(loader) if _sized(loader) and len(loader) else float("nan")
        return report

    def _selection_forward(self, batch) -> torch.Tensor:
        """One no-grad forward of ``batch`` through the strategy's wrapped model; its real tokens."""
        strategy = self.trainer.strategy
        batch = strategy.batch_to_device(batch)
        with strategy.precision_plugin.train_step_context():
            if strategy.model is not None and strategy.model is not self:
                return strategy._forward_redirection(strategy.model, self, "selection_step", batch)
            return self.selection_step(batch)

    def selection_step(self, batch) -> torch.Tensor:
        """The pre-phase's forward (no labels, no loss, last-position logits only): routes and counts loads."""
        mask = real_token_mask(batch)
        inputs = model_inputs(batch)
        inputs.pop("labels")
        inputs["use_cache"] = False
        if "logits_to_keep" in inspect.signature(self.model.forward).parameters:
            inputs["logits_to_keep"] = 1
        with self.patch.context.real_tokens(mask):
            self.model(**inputs)
        return mask.sum()

    def selection_line(self) -> str:
        """One line: when and how the condensers are chosen, and on how many tokens."""
        updater, trainer = self.patch.bias_updater, self.trainer
        n = self.patch.layers[0].forced_expert_ids.numel()
        every = "micro-batch" if updater.update_every == "micro_batch" else "optimizer step"
        rule = (f"gamma {updater.gamma:g}, load {updater.load}, {updater.select}, budget "
                f"{self.patch.condenser_routing['budget']}, condenser biases {updater.condenser_bias}")
        if n == 0:
            return (f"condenser: n=0: biases only, no condensers; one bias update per {every} from step 0 "
                    f"({rule})")
        chosen = {layer.index: layer.forced_experts for layer in self.patch.layers}
        report = self.selection_report
        if report is not None:
            per_update = 1 if updater.update_every == "micro_batch" else trainer.accumulate_grad_batches
            return (f"condenser: condensers chosen before step 0 by a forward-only pre-phase (no gradients, no "
                    f"optimizer or LR-schedule step): {report['updates']} bias updates, one per {per_update} "
                    f"micro-batch(es) per rank, over {report['micro_batches']:,} micro-batches on "
                    f"{trainer.world_size} rank(s) = {report['tokens']:,} tokens ({report['passes']:.2f} passes over "
                    f"the training data); {rule}: {condenser_summary(chosen)}; training then runs all its steps "
                    "from step 0")
        if updater.pending:
            total, how = self._updates_in_run()
            return (f"condenser: condensers chosen during training after {updater.selection_updates} bias updates "
                    f"of {total} ({how}), from the tokens routed until then; the weights train from step 0, "
                    f"without condensers until then ({rule})")
        source = self.hparams.get("options", {})
        origin = (f"bias_file={source['bias_file']}" if source.get("bias_file") else
                  "experts=" if source.get("experts") else
                  f"the checkpoint (resumed at optimizer step {trainer.global_step})")
        return (f"condenser: condensers fixed at once from {origin} (biases learned on "
                f"{selection_tokens(self.patch):,.0f} tokens before the choice; {rule}): {condenser_summary(chosen)}")

    # training ---------------------------------------------------------------------------------
    def on_after_backward(self):
        """``update_every=micro_batch``: the micro-batch's bias update, after its backward (an activation-checkpointed
        forward recomputed there routes with the biases of its first pass). Not in ``on_train_batch_end``: Lightning
        calls the callbacks' hook, which writes the step's checkpoint, before the module's, so the update of the
        micro-batch that ends a step would miss that checkpoint and never be replayed on resume (issue 21)."""
        super().on_after_backward()
        if self.patch.bias_updater.update_every == "micro_batch":
            self.patch.update_biases()

    def on_save_checkpoint(self, checkpoint):
        """The checkpoint of the step that ends training also writes ``condenser.json``: a run killed after
        that checkpoint, resumed (which trains nothing and skips ``on_train_end``), has it all the same."""
        super().on_save_checkpoint(checkpoint)
        if self.trainer.is_global_zero and ends_training(self.trainer):
            save_condenser_state(self.patch, Path(self.trainer.default_root_dir) / STATE_FILE)

    def on_train_end(self):
        if self.trainer.is_global_zero:
            save_condenser_state(self.patch, Path(self.trainer.default_root_dir) / STATE_FILE)
        self.trainer.strategy.barrier("condenser_state")


def _sized(loader) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def _cycle(loader) -> Iterator:
    """The loader's batches, starting it again when it runs out."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("condenser selection=pre_phase: the training dataloader yields no batch")
