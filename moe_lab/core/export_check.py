"""Refuse an incomplete compression export. The tasks below write their ``export/`` with its manifest
(``compress_manifest.json``, or ``condense_manifest.json`` for a condensed model) in one atomic step; a directory
of theirs with weights but no manifest was cut short (a kill under the former in-place writer, a partial copy)
and would be scored under the wrong label. Which task (and method) wrote it comes from its run's ``config.yaml``:
``<run>/export``, or ``<run>/points/<point>/export`` of task=expert_removal."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from .task_table import POINT_EXPORTS, RUN_EXPORT, tasks_where

#: the manifest a compression export carries (moe_lab.compress.dense), and a condensed model's (moe_lab.compress.condense)
MANIFEST_FILE = "compress_manifest.json"
CONDENSE_FILE = "condense_manifest.json"

#: tasks whose ``<run>/export`` always carries a manifest (task=moe_to_dense's stages hold theirs: its
#: ``distill/export``, a trained student, has none): the task table's ``manifest="run"`` rows
MANIFEST_TASKS = tasks_where(manifest=RUN_EXPORT)
#: tasks whose ``<run>/points/<point>/export`` always carries one (each point's pruned model, the base row's too)
POINT_TASKS = tasks_where(manifest=POINT_EXPORTS)
#: methods whose training export always carries one (the condensed format: condense_manifest.json)
MANIFEST_METHODS = ("condense_sft",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def writer(export: Path) -> tuple[str | None, str | None, Path | None]:
    """``(task.name, method.name, run dir)`` of the run that wrote ``export`` (its ``config.yaml``), if recorded."""
    runs = [(export.parent, None)]
    if export.parent.parent.name == "points":
        runs.append((export.parent.parent.parent, POINT_TASKS))
    for run, tasks in runs:
        config = run / "config.yaml"
        if config.is_file():
            cfg = OmegaConf.load(config)
            task = OmegaConf.select(cfg, "task.name")
            if tasks is None or task in tasks:
                return task, OmegaConf.select(cfg, "method.name"), run
    return None, None, None


def writer_task(export: Path) -> str | None:
    """``task.name`` of the run that wrote ``export``, if recorded."""
    return writer(export)[0]


def check_export(path, field: str) -> None:
    """Raise ``FileNotFoundError`` naming what is missing when ``path`` (the value of ``field``) is an export of a
    :data:`MANIFEST_TASKS` / :data:`POINT_TASKS` run or a :data:`MANIFEST_METHODS` training run without its
    manifest."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        return
    task, method, run = writer(path)
    needs = task in MANIFEST_TASKS or (task in POINT_TASKS and run != path.parent) or method in MANIFEST_METHODS
    if not needs or any((path / name).is_file() for name in (MANIFEST_FILE, CONDENSE_FILE)):
        return
    missing = [f"{MANIFEST_FILE} (or {CONDENSE_FILE})"]
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append("the tokenizer (tokenizer.json, tokenizer_config.json)")
    what = f"task={task}" + (f" method={method}" if method in MANIFEST_METHODS else "")
    raise FileNotFoundError(
        f"{field}={path}: an incomplete export of {what} (run {run}): it lacks {' and '.join(missing)}; "
        f"the run was interrupted while writing it. Re-run that task to export it again")
