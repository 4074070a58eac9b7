"""Refuse an incomplete compression export. The tasks below write their ``export/`` with its manifest
(``compress_manifest.json``, or ``condense_manifest.json`` for a condensed model) in one atomic step; a directory
of theirs with weights but no manifest was cut short (a kill under the former in-place writer, a partial copy)
and would be scored under the wrong label. Which task wrote it comes from its run's ``config.yaml``."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from .condense import CONDENSE_FILE
from .dense import MANIFEST_FILE

#: tasks whose ``<run>/export`` always carries a manifest (task=moe_to_dense's stages hold theirs: its
#: ``distill/export``, a trained student, has none)
MANIFEST_TASKS = ("compress", "condense", "d2d_prune")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def writer_task(export: Path) -> str | None:
    """``task.name`` of the run whose directory holds ``export`` (its ``config.yaml``), if recorded."""
    config = export.parent / "config.yaml"
    if not config.is_file():
        return None
    return OmegaConf.select(OmegaConf.load(config), "task.name")


def check_export(path, field: str) -> None:
    """Raise ``FileNotFoundError`` naming what is missing when ``path`` (the value of ``field``) is an export of a
    :data:`MANIFEST_TASKS` run without its manifest."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        return
    task = writer_task(path)
    if task not in MANIFEST_TASKS or any((path / name).is_file() for name in (MANIFEST_FILE, CONDENSE_FILE)):
        return
    missing = [f"{MANIFEST_FILE} (or {CONDENSE_FILE})"]
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append("the tokenizer (tokenizer.json, tokenizer_config.json)")
    raise FileNotFoundError(
        f"{field}={path}: an incomplete export of task={task} (run {path.parent}): it lacks {' and '.join(missing)}; "
        f"the run was interrupted while writing it. Re-run that task to export it again")
