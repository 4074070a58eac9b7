"""What a fine-tuning run refuses before its first step, in one function (:func:`refuse_before_first_step`) that
the run (:func:`moe_lab.runs.training._finetune`, on the method it built) and ``plan=true``
(:func:`moe_lab.runs.plan.check_method`, on the method built on the meta model) both call, so the plan refuses
exactly what the run would. The methods raise at fit start through the same message functions below (a module
built outside run.py is still refused)."""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from ..moe.experts_backend import refuse_method_backend
from .expert_parallel import check_method, ep_size
from .preflight import check_numbers
from .strategies import config_strategy_kind, refuse_unsupported

EXPORT_ONLY = ("KDModule(export_only=True) has no teacher: it converts or exports a checkpoint and cannot train "
               "(build it without export_only)")


def refuse_before_first_step(cfg: DictConfig, module, optimizer_steps: float | None = None) -> None:
    """Refuse ``cfg``'s run with ``module`` (its built method) for what it would refuse before its first step: the
    config's numbers, the method on its experts kernel and under the hardware's strategy and precision, FSDP's clipping, a method that
    cannot train, and (given the run's ``optimizer_steps``) a schedule or condenser choice the run's length
    cannot honour. The run passes no ``optimizer_steps`` (its trainer counts them at fit start, and the method
    refuses through the same functions there); the plan passes the steps it counted. The numbers are checked for
    task=finetune (as the preflight does; a multi-stage task's stages set their own)."""
    if cfg.task.name == "finetune":
        check_numbers(cfg)
    refuse_method_backend(OmegaConf.select(cfg, "method.method"), OmegaConf.select(cfg, "model.experts_implementation"))
    kind = config_strategy_kind(cfg.hardware.trainer)
    refuse_unsupported(module, kind, OmegaConf.select(cfg, "hardware.trainer.precision"))
    refuse_expert_parallel(module, kind, ep_size(cfg))
    if OmegaConf.select(cfg, "task.trainer.gradient_clip_val", default=None):
        check_fsdp_clipping(kind, OmegaConf.select(cfg, "task.trainer.gradient_clip_algorithm", default=None))
    if getattr(module, "export_only", False):
        raise ValueError(EXPORT_ONLY)
    if optimizer_steps is None:
        return
    scheduler = getattr(module, "scheduler_cfg", None)
    if scheduler is not None:
        check_schedule_length(scheduler, optimizer_steps)
    updater = getattr(getattr(module, "patch", None), "bias_updater", None)
    if updater is not None and updater.pending and updater.selection == "in_run":
        accumulate = int(OmegaConf.select(cfg, "task.trainer.accumulate_grad_batches", default=1) or 1)
        check_in_run_choice(updater, optimizer_steps, accumulate)


def refuse_expert_parallel(module, kind: str, size: int) -> None:
    """``hardware.ep_size > 1`` composes with DDP for the dense part, for the methods that run under EP."""
    if size <= 1:
        return
    if kind != "ddp":
        raise ValueError(f"hardware.ep_size={size} under a {kind} strategy: expert parallelism composes with DDP for the "
                         "dense part (hardware=gpu_ep, or ddp_cpu_ep on CPU); ZeRO and FSDP with EP are not built")
    check_method(module, size)


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
