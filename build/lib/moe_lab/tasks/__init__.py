"""Tasks that ``run.py`` dispatches on ``cfg.task.name``."""

from __future__ import annotations

from collections.abc import Callable


def _finetune(cfg):
    from .finetune import finetune

    return finetune(cfg)


def _evaluate(cfg):
    from .evaluate import evaluate

    return evaluate(cfg)


def _condenser_two_phase(cfg):
    from .condenser_two_phase import condenser_two_phase

    return condenser_two_phase(cfg)


TASKS: dict[str, Callable] = {"finetune": _finetune, "evaluate": _evaluate,
                              "condenser_two_phase": _condenser_two_phase}


def _calibrate(cfg):
    from .calibrate import calibrate_task

    return calibrate_task(cfg)


TASKS["calibrate"] = _calibrate


def _compress(cfg):
    from .compress import compress

    return compress(cfg)


TASKS["compress"] = _compress


def _analysis(module: str, function: str):
    def run(cfg):
        import importlib

        return getattr(importlib.import_module(f".{module}", __package__), function)(cfg)

    return run


TASKS["estimate"] = _analysis("estimate", "estimate_task")
TASKS["condense"] = _analysis("condense", "condense_task")
TASKS["cd_moe_sft"] = _analysis("cd_moe_sft", "cd_moe_sft")
TASKS["correlation"] = _analysis("correlation", "correlation_task")
TASKS["activation_stats"] = _analysis("activation_stats", "activation_stats_task")
TASKS["offload"] = _analysis("offload", "offload_task")
TASKS["moe_to_dense"] = _analysis("moe_to_dense", "moe_to_dense")
TASKS["teacher_logits"] = _analysis("teacher_logits", "teacher_logits_task")
TASKS["expert_removal"] = _analysis("expert_removal", "expert_removal_task")
TASKS["dense_diagnostics"] = _analysis("dense_diagnostics", "dense_diagnostics_task")
TASKS["d2d_prune"] = _analysis("d2d_prune", "d2d_prune_task")


def run_task(cfg):
    """Run ``cfg.task.name`` and return its summary dict. Every task holds its run directory
    (:class:`~moe_lab.runtime.run_lock.RunLock`: a second run into it is refused; the temporaries a killed run left are removed)."""
    from ..runtime.run_lock import RunLock

    name = cfg.task.name
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(sorted(TASKS))}")
    with RunLock(cfg.paths.output_dir):
        return TASKS[name](cfg)
