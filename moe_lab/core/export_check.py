"""Refuse an incomplete compression export. The tasks below write their ``export/`` with its manifest
(``compress_manifest.json``, or ``condense_manifest.json`` for a condensed model) in one atomic step; a directory
of theirs with weights but no manifest was cut short (a kill under the former in-place writer, a partial copy)
and would be scored under the wrong label. Which task (and method) wrote it comes from its run's ``config.yaml``:
``<run>/export``, or ``<run>/points/<point>/export`` of task=expert_removal."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from .method_class import module_fact
from .task_table import POINT_EXPORTS, RUN_EXPORT, tasks_where

#: the manifest a compression export carries (moe_lab.compress.dense), and a condensed model's (moe_lab.compress.condense)
MANIFEST_FILE = "compress_manifest.json"
CONDENSE_FILE = "condense_manifest.json"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def writer(export: Path):
    """``(task.name, method config, run dir)`` of the run that wrote ``export`` (its ``config.yaml``), if recorded."""
    runs = [(export.parent, None)]
    if export.parent.parent.name == "points":
        runs.append((export.parent.parent.parent, tasks_where(manifest=POINT_EXPORTS)))
    for run, tasks in runs:
        config = run / "config.yaml"
        if config.is_file():
            cfg = OmegaConf.load(config)
            task = OmegaConf.select(cfg, "task.name")
            if tasks is None or task in tasks:
                return task, OmegaConf.select(cfg, "method"), run
    return None, None, None


def check_export(path, field: str) -> None:
    """Raise ``FileNotFoundError`` naming what is missing when ``path`` (the value of ``field``) is an export of a
    task whose row of the task table says ``manifest="run"`` (``"points"``: an export of one of its points), or of
    a training run whose LightningModule states an ``export_manifest`` (method=condense_sft), without its manifest
    (task=moe_to_dense's ``distill/export``, a trained student, needs none)."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        return
    task, method_cfg, run = writer(path)
    of_points = task in tasks_where(manifest=POINT_EXPORTS) and run != path.parent
    by_method = method_cfg is not None and module_fact(method_cfg, "export_manifest") is not None
    method = None if method_cfg is None else OmegaConf.select(method_cfg, "name")
    needs = task in tasks_where(manifest=RUN_EXPORT) or of_points or by_method
    if not needs or any((path / name).is_file() for name in (MANIFEST_FILE, CONDENSE_FILE)):
        return
    missing = [f"{MANIFEST_FILE} (or {CONDENSE_FILE})"]
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append("the tokenizer (tokenizer.json, tokenizer_config.json)")
    what = f"task={task}" + (f" method={method}" if by_method else "")
    raise FileNotFoundError(
        f"{field}={path}: an incomplete export of {what} (run {run}): it lacks {' and '.join(missing)}; "
        f"the run was interrupted while writing it. Re-run that task to export it again")
