"""The tasks that ``run.py`` dispatches on ``cfg.task.name``: each module here is the run of one row of the task
table (:mod:`moe_lab.core.task_table`) that composes runs (:mod:`moe_lab.runs`) and library calls; a task whose run
is one of :mod:`moe_lab.runs` has no module here."""

from __future__ import annotations

from ..core.task_table import TASKS

__all__ = ["TASKS", "run_task"]


def run_task(cfg):
    """Run ``cfg.task.name`` and return its summary dict. Every task holds its run directory
    (:class:`~moe_lab.runtime.run_lock.RunLock`: a second run into it is refused; the temporaries a killed run left
    are removed)."""
    from ..runtime.run_lock import RunLock

    name = cfg.task.name
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(sorted(TASKS))}")
    with RunLock(cfg.paths.output_dir):
        return TASKS[name].function()(cfg)
