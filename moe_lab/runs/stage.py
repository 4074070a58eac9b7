"""The stages of a multi-stage task (moe_to_dense, cd_moe_sft, condenser_two_phase): each runs in its own folder of the run directory on
a copy of the run's config, and leaves a done-marker holding its summary. ``task.resume=<run dir>`` reuses every
stage that finished and continues the one that did not from what it wrote (a training stage from its
``checkpoints/last.ckpt``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from ..core.atomic import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

#: a finished stage's marker, in its folder: the stage's summary and the folder it ran in, written once the stage has
#: returned
STAGE_DONE = "stage_done.json"


def stage_config(cfg: DictConfig, out: Path, **updates) -> DictConfig:
    """A copy of ``cfg`` writing to ``out`` with dotted-key updates. Interpolations stay unresolved, so whatever
    refers to ``${paths.output_dir}`` (the CSV and W&B loggers' ``save_dir``, checkpoints) follows ``out``."""
    sub = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    out.mkdir(parents=True, exist_ok=True)
    with open_dict(sub):
        for key, value in {"paths.output_dir": str(out), **updates}.items():
            OmegaConf.update(sub, key, value, merge=False)
    return sub


def run_stage(cfg: DictConfig, name: str, run: Callable[[DictConfig], dict], **updates) -> dict:
    """Stage ``name`` of ``cfg``'s run: ``run`` on :func:`stage_config` in ``<run dir>/<name>/`` with ``updates``,
    its resolved config written there as ``config.yaml`` (as run.py writes one per run), and its summary returned.

    When the run resumes (``task.resume``), a stage whose :data:`STAGE_DONE` marker exists is not run again: its
    summary is read back, in one line. A stage that did not finish runs again in its folder and continues what it
    wrote there (a partial calibration, finished search steps, a training stage's ``last.ckpt``, which its
    ``task.resume`` points at). The marker is written atomically once ``run`` returns: a kill leaves none."""
    folder = Path(cfg.paths.output_dir) / name
    marker = folder / STAGE_DONE
    resuming = bool(OmegaConf.select(cfg, "task.resume", default=None))
    if resuming and marker.is_file():
        done = json.loads(marker.read_text())
        log.info("stage %s: finished in an earlier segment of this run (%s), reused", name, marker)
        return _moved(done["summary"], done["folder"], str(folder))
    if resuming and folder.is_dir() and any(folder.iterdir()):
        log.info("stage %s: not finished in an earlier segment (no %s): it runs again in %s, continuing what it wrote "
                 "there", name, STAGE_DONE, folder)
    checkpoint = folder / "checkpoints" / "last.ckpt"
    stage = stage_config(cfg, folder, **{"task.resume": str(folder) if resuming and checkpoint.exists() else None,
                                         **updates})
    if rank_zero_only.rank == 0:  # a stage run under DDP: one writer
        atomic_write_text(folder / "config.yaml", OmegaConf.to_yaml(stage, resolve=True))
    summary = run(stage)
    if rank_zero_only.rank == 0:
        atomic_write_json(marker, {"folder": str(folder), "summary": summary}, indent=2, default=str)
    return summary


def _moved(value, old: str, new: str):
    """``value`` (a stage summary) with the paths under the stage's folder ``old`` moved to ``new`` (a run directory
    copied or moved since the stage ran resumes from its new place)."""
    if isinstance(value, dict):
        return {k: _moved(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_moved(v, old, new) for v in value]
    if isinstance(value, str) and old != new and (value == old or value.startswith(old + "/")):
        return new + value[len(old):]
    return value
