"""Checkpoints of an optimizer step that Lightning validates after are written once that validation has ended.

Lightning validates after ``on_train_batch_end`` (in the epoch loop's ``on_advance_end``). A checkpoint written in
``on_train_batch_end`` of such a step resumes past the validation, which Lightning does not run again (it fast-
forwards the validation progress): a run killed during that validation loses its ``val/*`` row. Written in
``on_validation_end`` instead, the checkpoint holds the state after the validation (logged by then), and Lightning,
resuming it, skips that validation only (``RESTARTED_ON_LAST``); a run killed during the validation resumes from
the checkpoint before, and validates at that step again.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch.callbacks import Callback


def validation_follows(trainer) -> bool:
    """Whether Lightning validates right after the current training batch: its own test (made again in
    ``on_advance_end``), and a validation loader with batches (an empty one is skipped without
    ``on_validation_end``)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not trainer.training or not epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher):
        return False
    val_loop = epoch_loop.val_loop
    val_loop.setup_data()  # what the validation does first (a no-op once done), so that its length is known
    return not val_loop.skip


class AfterValidation(Callback):
    """A callback (or a mixin before another callback class) whose end-of-step work goes through
    :meth:`at_step_end`: done at once, or at the end of the validation that follows the batch."""

    def at_step_end(self, trainer, action: Callable[[], None]) -> None:
        """``action()`` now, or in ``on_validation_end`` when Lightning validates after this batch."""
        if validation_follows(trainer):
            self._after_validation = action
        else:
            action()

    def on_validation_end(self, trainer, pl_module) -> None:
        action = self.__dict__.pop("_after_validation", None)
        if action is not None:
            action()
        super().on_validation_end(trainer, pl_module)


class ResumeAfterValidation(Callback):
    """Resuming a checkpoint written during a validation, the rows keep their steps also when the resumed run does
    not validate at that step (``limit_val_batches=0``, another ``val_check_interval``).

    Lightning advances the loggers' step (``_batches_that_stepped``) after the validation, so such a checkpoint
    holds the step before. Resuming it, Lightning advances the step where it would validate (and skips that
    validation); elsewhere it does not, and the first resumed row would repeat the previous step: this callback
    advances it then, when training starts. Each checkpoint records whether it was written during a validation."""

    KEY = "moe_lab_written_in_validation"

    def __init__(self):
        self.resumed_in_validation = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        checkpoint[self.KEY] = bool(trainer.validating)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.resumed_in_validation = bool(checkpoint.get(self.KEY))

    def on_train_start(self, trainer, pl_module) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if self.resumed_in_validation and not epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher):
            epoch_loop._batches_that_stepped += 1
        self.resumed_in_validation = False
