"""The task table: one row per ``task=X`` of ``run.py``, holding every fact about that task that is not in its run
or its config (``conf/task/X.yaml``). ``run.py`` (dispatch, ``task.resume``, open maps), ``plan=true`` (which
tasks show a trainer) and the export check (which exports carry a manifest) read this table and nothing else.

A row names its run as ``"module:function"``: the dispatcher (:func:`moe_lab.tasks.run_task`) imports that module
when the task runs, so the table is plain data on the ground floor and importing it loads no task. Adding a task
is its run, its row here and its config (docs/how-to-add.md)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

#: the resume of a task whose row says ``resume=TASK_RESUME``: ``python run.py task.resume=<run dir>`` re-applies the
#: run's overrides and runs in its directory, where the task continues what it finished (a checkpoint, finished
#: points, predictions, stages)
TASK_RESUME = "task.resume=<run dir>"
#: what ``task.resume`` says of a task that keeps no partial work
NO_RESUME = "it does not resume, run it again"
#: ``manifest=`` values: every ``<run>/export`` carries a manifest; every ``<run>/points/<point>/export`` does
RUN_EXPORT, POINT_EXPORTS = "run", "points"


@dataclass(frozen=True)
class Task:
    """One task of ``run.py``.

    - ``name``: ``task=<name>`` (``conf/task/<name>.yaml`` sets ``task.name`` to it);
    - ``run``: ``"module:function"``, called with the composed config; returns the run's summary dict;
    - ``trains``: the task trains with Lightning (``plan=true`` shows its trainer, steps and schedule);
    - ``resume``: how a cut-short run continues: :data:`TASK_RESUME`, a sentence, or :data:`NO_RESUME`;
    - ``manifest``: :data:`RUN_EXPORT` / :data:`POINT_EXPORTS` where its exports always carry a compression
      manifest (an export without one was cut short and is refused), else None;
    - ``open_maps``: the ``{}`` maps of its config the command line fills with new keys (``task.checkpoints.a=...``).
    """

    name: str
    run: str
    trains: bool = False
    resume: str = NO_RESUME
    manifest: str | None = None
    open_maps: tuple[str, ...] = ()

    def __post_init__(self):
        if self.run.count(":") != 1:
            raise ValueError(f"task {self.name}: run={self.run!r} must be 'module:function'")
        if self.manifest not in (None, RUN_EXPORT, POINT_EXPORTS):
            raise ValueError(f"task {self.name}: manifest={self.manifest!r}: choose None, {RUN_EXPORT!r} or "
                             f"{POINT_EXPORTS!r}")

    def function(self) -> Callable:
        """The run, imported."""
        module, _, function = self.run.partition(":")
        return getattr(importlib.import_module(module), function)


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("finetune", "moe_lab.runs.training:finetune", trains=True, resume=TASK_RESUME),
    Task("evaluate", "moe_lab.runs.evaluate:evaluate", resume=TASK_RESUME),  # the sets' predictions already written
    Task("condenser_two_phase", "moe_lab.tasks.condenser_two_phase:condenser_two_phase", trains=True,
         resume=TASK_RESUME),  # done phases
    Task("calibrate", "moe_lab.runs.calibrate:calibrate_task", resume=TASK_RESUME),  # its calibration.partial
    Task("compress", "moe_lab.runs.compress:compress", manifest=RUN_EXPORT, resume=TASK_RESUME),  # points.csv
    Task("estimate", "moe_lab.tasks.estimate:estimate_task"),
    Task("condense", "moe_lab.runs.condense:condense_task", manifest=RUN_EXPORT,
         resume=TASK_RESUME),  # search_progress.csv
    Task("cd_moe_sft", "moe_lab.tasks.cd_moe_sft:cd_moe_sft", trains=True, resume=TASK_RESUME),  # done stages
    Task("correlation", "moe_lab.tasks.correlation:correlation_task", open_maps=("task.checkpoints",)),
    Task("activation_stats", "moe_lab.tasks.activation_stats:activation_stats_task", open_maps=("task.runs",)),
    Task("offload", "moe_lab.tasks.offload:offload_task", open_maps=("task.logs",)),
    Task("moe_to_dense", "moe_lab.tasks.moe_to_dense:moe_to_dense", trains=True, resume=TASK_RESUME),  # done stages
    Task("teacher_logits", "moe_lab.tasks.teacher_logits:teacher_logits_task"),
    Task("expert_removal", "moe_lab.tasks.expert_removal:expert_removal_task", manifest=POINT_EXPORTS,
         resume=TASK_RESUME),  # the finished points' predictions
    Task("dense_diagnostics", "moe_lab.tasks.dense_diagnostics:dense_diagnostics_task"),
    Task("d2d_prune", "moe_lab.tasks.d2d_prune:d2d_prune_task", manifest=RUN_EXPORT, open_maps=("task.candidates",)),
)}


def tasks_where(**facts) -> tuple[str, ...]:
    """Names of the tasks whose rows hold ``facts`` (``tasks_where(trains=True)``), in table order."""
    return tuple(name for name, t in TASKS.items() if all(getattr(t, k) == v for k, v in facts.items()))
