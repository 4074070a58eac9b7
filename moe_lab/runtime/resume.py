"""Resuming a run without losing its history.

``task.resume=<run dir>`` continues ``<run dir>/checkpoints/last.ckpt`` in that directory (run.py re-applies the
run's own overrides); ``task.ckpt_path=<file>`` continues a checkpoint in a new directory. Either way the
metrics logged before the checkpoint step are carried into the new ``metrics.csv`` (so plots cover the
whole run), earlier heatmaps are copied over, the W&B run id stored beside the checkpoint continues the same
W&B run, and the wall time adds up across segments.
"""

from __future__ import annotations

import csv
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf, open_dict

from ..core.settings import RunLength
from .after_validation import AfterValidation

log = logging.getLogger(__name__)

WANDB_ID_FILE = "wandb_run_id"  # in <run dir>/checkpoints/, beside last.ckpt


def resume_checkpoint(cfg: DictConfig) -> tuple[Path | None, str]:
    """``(checkpoint file or None, the config field it came from)`` for ``task.resume`` / ``task.ckpt_path``."""
    resume = cfg.task.get("resume")
    if resume:
        path = Path(str(resume)).expanduser()
        if path.is_dir() and (path / "latest").is_file():  # a DeepSpeed checkpoint directory
            return path, "task.resume"
        if path.is_dir():
            ckpt = path / "checkpoints" / "last.ckpt"
            if not ckpt.exists():  # a file, or a DeepSpeed checkpoint directory
                raise FileNotFoundError(f"task.resume={resume}: {ckpt} does not exist (the run wrote no checkpoint "
                                        "yet; checkpoints come every task.checkpoint_every_n_steps and on Ctrl-C)")
            return ckpt, "task.resume"
        if path.is_file():
            return path, "task.resume"
        raise FileNotFoundError(f"task.resume={resume}: no such run directory or checkpoint file")
    if cfg.task.get("ckpt_path"):
        return Path(str(cfg.task.ckpt_path)).expanduser(), "task.ckpt_path"
    return None, ""


def check_progress(ckpt: dict, cfg: DictConfig, field: str) -> None:
    """Say what a resume will train before it trains nothing.

    ``task.trainer.max_steps`` above the checkpoint's step while the run has already done its
    ``task.trainer.max_epochs`` epochs (e.g. a finished one-epoch run extended with more steps) would train 0
    steps: refused, naming the fix. A checkpoint at ``max_steps`` (or with its epochs done) and no larger limit
    given resumes to nothing (the export and evaluation are redone) and is logged as such."""
    trainer = {**OmegaConf.to_container(cfg.hardware.trainer, resolve=True),
               **OmegaConf.to_container(cfg.task.trainer, resolve=True)}
    step = int(ckpt.get("global_step", 0))
    length = RunLength.given(trainer)
    max_steps, max_epochs = length.step_limit, length.epoch_limit
    loop = ckpt.get("loops", {}).get("fit_loop", {})
    progress = loop.get("epoch_progress", {}).get("current", {})
    epochs = progress.get("processed", ckpt.get("epoch"))
    if epochs is not None and progress.get("started", 0) > epochs and \
            loop.get("epoch_loop.batch_progress", {}).get("is_last_batch"):
        epochs += 1  # saved at the epoch's last batch, before the epoch loop counted it
    steps_left = max_steps is None or step < max_steps
    epochs_done = max_epochs is not None and epochs is not None and int(epochs) >= max_epochs
    where = f"{field}: the checkpoint is at step {step}"
    if max_steps is not None and step < max_steps and epochs_done:
        raise ValueError(f"{where} after {epochs} epoch(s) = task.trainer.max_epochs={max_epochs}, so task.trainer."
                         f"max_steps={max_steps} would train 0 more steps. To extend the run by steps, also pass "
                         "task.trainer.max_epochs=-1 (max_steps then ends it); by epochs, a larger "
                         "task.trainer.max_epochs")
    if not steps_left or epochs_done:
        log.warning("%s, which is already the end of the run (task.trainer.max_steps=%s, max_epochs=%s): nothing is "
                    "trained. To extend it pass a larger task.trainer.max_steps (with max_epochs=-1) or max_epochs",
                    where, trainer.get("max_steps"), trainer.get("max_epochs"))


class LastStepCheckpoint(AfterValidation):
    """Writes ``last.ckpt`` at the batch that reaches ``max_steps``, inside the epoch, as a periodic checkpoint is
    (after the validation due at that step, :mod:`moe_lab.runtime.after_validation`).

    Lightning's own end-of-training save comes after the epoch loop has closed, so a run stopped by ``max_steps``
    mid-epoch is recorded as having finished that epoch: resumed with more steps it would start a new epoch (the
    rest of this one never seen) or, at ``max_epochs``, train nothing."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        saver = trainer.checkpoint_callback
        if saver is None or trainer.max_steps is None or trainer.max_steps < 0:
            return
        if trainer.global_step >= trainer.max_steps:
            self.at_step_end(trainer, lambda: self._save(trainer, saver))

    @staticmethod
    def _save(trainer, saver) -> None:
        if saver._last_global_step_saved != trainer.global_step:
            saver._save_last_checkpoint(trainer, saver._monitor_candidates(trainer))


def _complete_lines(path: Path, step: int) -> list[str]:
    """The lines of ``metrics.csv`` up to its last complete one: a file cut mid-line (killed while the logger
    wrote, a disk full) loses its partial last line, said in one line with the step it now ends at against the
    checkpoint's ``step`` (a shortened value is never carried into the resumed run)."""
    text = path.read_text()
    if not text or text.endswith("\n"):
        return text.splitlines(keepends=True)
    lines = text.splitlines(keepends=True)
    partial = lines.pop()
    steps = [r.get("step") for r in csv.DictReader(lines)]
    last = next((int(float(s)) for s in reversed(steps) if s), None)
    lost = f"; rows the run logged after step {last} up to the checkpoint's step {step} are lost" \
        if last is not None and last < step - 1 else ""
    log.warning("%s was cut mid-line (its last line has no end: %r): that line is dropped, the rows carried end at "
                "step %s%s", path, partial[:60], last, lost)
    return lines


def _rows_before(path: Path, step: int) -> list[dict]:
    """Rows of a Lightning ``metrics.csv`` logged before ``step`` (non-empty cells only; a partial last line
    dropped, :func:`_complete_lines`)."""
    if not path.is_file():
        return []
    rows = []
    for row in csv.DictReader(_complete_lines(path, step)):
        try:
            row_step = int(float(row.get("step") or "nan"))
        except ValueError:
            continue
        if row_step < step:
            rows.append({k: _number(v) for k, v in row.items() if k != "step" and v not in ("", None)}
                        | {"step": row_step})
    return rows


def _number(text: str) -> int | float:
    """A metrics.csv cell as the logger wrote it: an integer stays one (``epoch`` is ``0``, not ``0.0``), the rest
    are floats (``repr`` round-trips them, so a carried row is written back as it was)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


class History:
    """What a resumed run carries over from the run that wrote its checkpoint (read before the loggers
    exist: Lightning's CSV logger deletes an existing metrics.csv when it starts)."""

    def __init__(self, ckpt: Path | None, global_step: int, out: Path):
        self.out = out
        self.step = global_step
        self.old_run = None if ckpt is None else ckpt.parent.parent
        self.rows = [] if ckpt is None else _rows_before(self.old_run / "metrics.csv", global_step)
        id_file = None if ckpt is None else ckpt.parent / WANDB_ID_FILE
        self.wandb_id = id_file.read_text().strip() if id_file is not None and id_file.is_file() else None

    def replay(self, loggers) -> None:
        """Write the earlier rows into every CSV logger's file, and copy earlier heatmaps into a new run dir."""
        for logger in loggers:
            if isinstance(logger, CSVLogger) and self.rows:
                writer = logger.experiment
                for row in self.rows:
                    writer.log_metrics({k: v for k, v in row.items() if k != "step"}, step=row["step"])
                writer.save()
        if self.old_run is None or self.old_run.resolve() == self.out.resolve():
            return
        for png in sorted((self.old_run / "plots").glob("expert_load_step*.png")):
            match = re.search(r"step(\d+)", png.name)
            target = self.out / "plots" / png.name
            if match and int(match.group(1)) <= self.step and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(png, target)
        if self.rows:
            log.info("resumed from %s at step %d: %d earlier metric rows carried into %s", self.old_run, self.step,
                     len(self.rows), self.out / "metrics.csv")


def wandb_logger_nodes(cfg: DictConfig) -> list[str]:
    """Names of the ``cfg.logger`` entries that are W&B loggers."""
    return [name for name, node in (cfg.get("logger") or {}).items()
            if node is not None and str(node.get("_target_", "")).endswith("WandbLogger")]


def pin_wandb_run(cfg: DictConfig, history: History, out: Path) -> str | None:
    """Give every W&B logger entry one run id (the resumed run's, else a new one), stored beside the checkpoint
    so that a resume continues the same W&B run; returns the id (None: no W&B logger)."""
    names = wandb_logger_nodes(cfg)
    if not names:
        return None
    run_id = history.wandb_id or uuid.uuid4().hex[:8]  # W&B's own id format: 8 lowercase alphanumerics
    with open_dict(cfg):
        for name in names:
            cfg.logger[name].id = run_id
            cfg.logger[name].resume = "allow"
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    (out / "checkpoints" / WANDB_ID_FILE).write_text(run_id + "\n")
    return run_id



# ---- what a resume may change (issue 21: refuse a changed trajectory, say every other change) -------------------
ALLOW_FIELD = "task.allow_resume_changes"
WORLD_SIZE = "world size"
#: record keys (prefixes) that decide which examples are seen in which optimizer step: refused unless allowed
TRAJECTORY = ("dataset.", "method.", WORLD_SIZE, "task.trainer.accumulate_grad_batches")
#: dataset keys that change how the data is loaded, not which data: never a change
LOADING_ONLY = ("dataset.num_workers", "dataset.pin_memory", "dataset.persistent_workers", "dataset.prefetch_factor")


def _flat(prefix: str, node) -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flat(f"{prefix}.{key}", value))
        return out
    return {prefix: node}


def _trainer_settings(cfg: DictConfig) -> dict:
    return {**OmegaConf.to_container(cfg.hardware.trainer, resolve=True),
            **OmegaConf.to_container(cfg.task.trainer, resolve=True)}


def config_world_size(cfg: DictConfig) -> int:
    """The number of training processes ``cfg.hardware`` / ``cfg.task.trainer`` ask for (devices x nodes)."""
    import torch

    trainer = _trainer_settings(cfg)
    devices, nodes = trainer.get("devices", "auto"), int(trainer.get("num_nodes") or 1)
    if isinstance(devices, (list, tuple)):
        count = len(devices)
    elif isinstance(devices, str) and "," in devices:
        count = len([d for d in devices.split(",") if d.strip()])
    elif str(devices).isdigit() and int(devices) > 0:
        count = int(devices)
    else:  # "auto" / -1: every visible accelerator
        gpu = str(trainer.get("accelerator", "auto")) in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        count = torch.cuda.device_count() if gpu else 1
    return count * nodes


def run_record(cfg: DictConfig, world_size: int) -> dict:
    """The settings a checkpoint records about the run that wrote it (flat, dotted config keys): the dataset, the
    method, the optimizer and schedule, the loop limits, the accumulation, the seed and the world size."""
    record = {}
    for key in ("dataset", "method", "task.optim", "task.scheduler"):
        node = OmegaConf.select(cfg, key)
        if node is not None:
            record.update(_flat(key, OmegaConf.to_container(node, resolve=True)))
    trainer = _trainer_settings(cfg)
    for key in ("max_steps", "max_epochs", "accumulate_grad_batches", "gradient_clip_val"):
        record[f"task.trainer.{key}"] = trainer.get(key)
    record["seed"] = cfg.get("seed")
    record[WORLD_SIZE] = int(world_size)
    out = OmegaConf.select(cfg, "paths.output_dir")
    return {k: _portable(v, out) for k, v in record.items() if not k.startswith(LOADING_ONLY)}


def _portable(value, output_dir):
    """A path inside the run (under the output directory's parent: a chained task's stages and their siblings) as
    ``<run>/...`` relative to the output directory, so a run directory that was moved or copied resumes as the
    same run; every other value unchanged."""
    if not (isinstance(value, str) and output_dir and os.path.isabs(value)):
        return value
    root = Path(str(output_dir)).parent
    try:
        Path(value).relative_to(root)
    except ValueError:
        return value
    return "<run>/" + os.path.relpath(value, str(output_dir))


def _recorded(ckpt: dict, path: Path) -> dict | None:
    """The checkpoint's run record; for a checkpoint of an older moe-lab, rebuilt from its run's config.yaml and
    the marker's world size (None: neither is there)."""
    import json

    from .checkpoint_io import marker_path

    record = (ckpt.get("moe_lab") or {}).get("run")
    if record is not None:
        return record
    config = next((d / "config.yaml" for d in (path.parent.parent, path.parent) if (d / "config.yaml").is_file()), None)
    marker = marker_path(path)
    if config is None or not marker.is_file():
        return None
    try:
        return run_record(OmegaConf.load(config), json.loads(marker.read_text()).get("world_size", 1))
    except Exception:  # noqa: BLE001 - not a finetune run's config: nothing to compare against
        return None


def check_changes(ckpt: dict, path: Path, cfg: DictConfig, field: str) -> dict | None:
    """Compare this run's settings with those of the run that wrote the checkpoint. A change of the trajectory
    (:data:`TRAJECTORY`) is refused unless ``task.allow_resume_changes=true``; every change that goes ahead is
    logged in one line. Returns the checkpoint's record (None: an older checkpoint without one)."""
    old = _recorded(ckpt, path)
    if old is None:
        log.warning("%s=%s records no settings of its run (an older moe-lab, no config.yaml beside it): changes of "
                    "dataset, method, batch size or world size cannot be checked", field, path)
        return None
    new = run_record(cfg, config_world_size(cfg))
    changes = [(k, old.get(k, "(unset)"), new.get(k, "(unset)")) for k in sorted(set(old) | set(new))
               if old.get(k, "(unset)") != new.get(k, "(unset)")]
    trajectory = [c for c in changes if c[0].startswith(TRAJECTORY)]
    if trajectory and not cfg.task.get("allow_resume_changes"):
        from .checkpoint_io import checkpoint_label

        listed = "; ".join(f"{k}: {a} -> {b}" for k, a, b in trajectory)
        labels = (f"the checkpoint is {checkpoint_label(ckpt, path)}, the config is "
                  f"{OmegaConf.select(cfg, 'model.name')} / {OmegaConf.select(cfg, 'method.name')}")
        raise ValueError(
            f"{field}={path}: {labels}; this run changes what the checkpoint's run trained on ({listed}), so the rest of it "
            "would not continue that run. Resume with the run's own settings (task.resume=<run dir> re-applies its "
            f"overrides; drop the ones above), or pass {ALLOW_FIELD}=true to continue with the changes")
    for key, before, after in changes:
        allowed = f" (allowed by {ALLOW_FIELD})" if key.startswith(TRAJECTORY) else ""
        log.warning("%s: %s: %s -> %s differs from the checkpoint's run%s", field, key, before, after, allowed)
    return old


def other_parameters(field: str, path: Path, method: str, recorded: dict | None) -> ValueError:
    """The refusal of a method change (allowed) whose method trains other parameters than the checkpoint's."""
    was = (recorded or {}).get("method.name", "another method")
    return ValueError(f"{field}={path}: method={method} trains other parameters than the checkpoint's method={was}, "
                      f"so its optimizer state cannot be restored. Resume with method={was}, or start a new run from "
                      "its weights (model.pretrained=<run dir>/export)")


def check_trainable(ckpt: dict, path: Path, module, cfg: DictConfig, field: str, recorded: dict | None) -> None:
    """After an allowed method change: refuse when the new method trains another number of parameters than the
    checkpoint's optimizer state holds (before any file of the run is touched, instead of torch's parameter-group
    error inside the fit)."""
    if not recorded or recorded.get("method.name") == cfg.method.name or not ckpt.get("optimizer_states"):
        return
    saved = sum(len(g["params"]) for g in ckpt["optimizer_states"][0].get("param_groups", []))
    trained = sum(1 for p in module.parameters() if p.requires_grad)
    if saved != trained:
        raise other_parameters(field, path, cfg.method.name, recorded)


def refuse_existing_run(cfg: DictConfig, out: Path) -> None:
    """A plain ``task=finetune`` (no ``task.resume`` / ``task.ckpt_path``) into a run directory that holds a
    checkpoint (complete, or a ``last.ckpt`` that lost its marker beside complete ``step-<n>.ckpt``) would start
    again from step 0 over that run's checkpoints and metrics: refused, naming the ``task.resume`` that continues
    it. (A requeued SLURM job continues it by itself: ``moe_lab.runtime.slurm.resume_requeued``.)"""
    import json

    from .checkpoint_io import marker_path

    ckpt = out / "checkpoints" / "last.ckpt"
    if cfg.task.get("name") != "finetune":
        return
    if not marker_path(ckpt).is_file():
        _refuse_unmarked_run(out, ckpt)
        return
    step = json.loads(marker_path(ckpt).read_text()).get("global_step", "?")
    raise ValueError(f"{out} already holds a run with a complete checkpoint at step {step} ({ckpt}): this command "
                     "would start it again from step 0 over its checkpoints and metrics.csv. Continue it with "
                     f"task.resume={out} (its own overrides are re-applied; add task.trainer.max_steps=<n> to train "
                     "longer), or give another hydra.run.dir")


def _refuse_unmarked_run(out: Path, ckpt: Path) -> None:
    """Refuse a plain re-run into ``out`` whose ``last.ckpt`` has no marker while checkpoints are there, naming the
    newest complete one (none: how to adopt one)."""
    from .checkpoint_io import MARKER, complete_beside

    written = sorted(p.name for p in ckpt.parent.glob("*.ckpt")) if ckpt.parent.is_dir() else []
    if not written:
        return
    how = complete_beside(ckpt)
    if how.startswith("No complete"):
        how = (f"None of them has a {MARKER} marker: if one is complete, continue it with task.resume="
               f"{ckpt.parent}/<file> task.adopt_checkpoint=true (it is re-verified first).")
    state = f"last.ckpt without its {MARKER} marker" if ckpt.exists() else "no last.ckpt"
    raise ValueError(f"{out} already holds a run's checkpoints ({', '.join(written)}; {state}): this command would "
                     f"start it again from step 0 over them and its metrics.csv. {how} Or give another hydra.run.dir")


# ---- run files written once a resume is accepted (issue 21.9) ----------------------------------------------------
_pending_run_files: list = []


def defer_run_files(write) -> None:
    """Hold ``write`` (run.py's writer of config.yaml and .hydra/) until :func:`accept_run`: a refused resume must
    not change the run's own files."""
    _pending_run_files[:] = [write]


def accept_run() -> None:
    """The run goes ahead: write the run files held by :func:`defer_run_files` (none held: nothing to do)."""
    while _pending_run_files:
        _pending_run_files.pop()()
