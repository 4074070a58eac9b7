"""The refusals a method raises at fit start and :func:`moe_lab.runs.checks.refuse_before_first_step` raises before
it (plan and run), in one message function each, so a module built outside run.py is refused as the run is."""

from __future__ import annotations

import math

EXPORT_ONLY = ("KDModule(export_only=True) has no teacher: it converts or exports a checkpoint and cannot train "
               "(build it without export_only)")


def check_fsdp_clipping(kind: str, algorithm: str | None) -> None:
    """FSDP clips by the global norm only (its ``clip_grad_norm_``)."""
    if kind == "fsdp" and algorithm not in (None, "norm"):
        raise ValueError(f"task.trainer.gradient_clip_algorithm={algorithm} under FSDP: only 'norm' is supported "
                         "(FSDP clip_grad_norm_); set it to norm or drop the clipping")


def check_schedule_length(scheduler, optimizer_steps: float) -> None:
    """A schedule other than a constant without warm-up ratio needs the run's number of optimizer steps."""
    if not math.isfinite(optimizer_steps) and (scheduler["name"] != "constant"
                                               or scheduler.get("warmup_ratio") is not None):
        raise ValueError(f"task.scheduler.name={scheduler['name']} needs the number of optimizer steps: set "
                         "task.trainer.max_steps (or max_epochs with a sized dataset)")


def check_in_run_choice(updater, optimizer_steps: float, accumulate: int) -> None:
    """``selection=in_run`` must choose the condensers before the run's last optimizer step (a run of unknown
    length is let through: the method warns)."""
    per_micro = updater.update_every == "micro_batch"
    total = optimizer_steps * accumulate if per_micro else optimizer_steps
    if not math.isfinite(total) or updater.selection_updates < total:
        return
    how = (f"one per micro-batch: {int(optimizer_steps)} optimizer steps x accumulate_grad_batches={accumulate}"
           if per_micro else f"one per optimizer step: {int(optimizer_steps)} optimizer steps")
    when = "never be chosen" if updater.selection_updates > total else "be chosen after the last step and never train"
    raise ValueError(
        f"method.options.selection=in_run chooses the condensers after selection_updates={updater.selection_updates} "
        f"bias updates, but this run makes {int(total)} ({how}): they would {when}. Use selection=pre_phase "
        f"(a forward-only pass before step 0, no training steps taken) or selection_updates < {int(total)}")
