"""What a run refuses before it starts, each in one function that plan and run both call, so ``plan=true``
refuses exactly what the run would: :func:`preflight` before anything loads (the config's numbers, this machine's
devices, memory and W&B), :func:`refuse_before_first_step` on the built method (its experts kernel, strategy,
precision, expert parallelism and schedule). The methods raise at fit start through the same message functions
(:mod:`moe_lab.runtime.refusals`), so a module built outside run.py is still refused."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ..methods.ep_support import check_method
from ..methods.registry import refuse_method_backend
from ..runtime.expert_parallel import ep_size
from ..runtime.preflight import check_hardware, check_numbers, check_wandb
from ..runtime.refusals import EXPORT_ONLY, check_fsdp_clipping, check_in_run_choice, check_schedule_length
from ..runtime.strategies import config_strategy_kind, refuse_unsupported
from .memory_fit import check_memory


def preflight(cfg: DictConfig, plan: bool = False) -> None:
    """All checks for ``cfg.task.name`` (the finetune checks only where they apply). ``plan=True`` (``plan=true``)
    keeps the checks of the config and skips those of this machine (CUDA, memory of its GPU, W&B's network):
    a plan is made anywhere and reports the memory instead of refusing."""
    if cfg.task.name == "finetune":
        check_numbers(cfg)
    if plan:
        return
    check_hardware(cfg)
    check_memory(cfg)
    check_wandb(cfg)


def refuse_before_first_step(cfg: DictConfig, module, optimizer_steps: float | None = None) -> None:
    """Refuse ``cfg``'s run with ``module`` (its built method) for what it would refuse before its first step: the
    config's numbers, the method on its experts kernel and under the hardware's strategy and precision, FSDP's clipping,
    a method that cannot train, and (given the run's ``optimizer_steps``) a schedule or condenser choice the run's length
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
