"""Checkpoints: atomic writes (a crash mid-save never leaves a truncated last.ckpt), one on SIGINT/SIGTERM/
SIGUSR1, and reading a checkpoint back with errors that say what it is."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves to a temporary file in the target directory, fsyncs, then renames over the target."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def read_checkpoint(path: str | Path, field: str = "task.ckpt_path") -> dict:
    """A task=finetune checkpoint, memory-mapped (cheap to open); a ``ValueError`` naming ``field`` when the
    file is not one (unreadable, or not a Lightning checkpoint with a state dict and moe-lab hyperparameters)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{field}={path}: no such file (resume with task.resume=<run dir>, or point "
                                f"{field} at <run dir>/checkpoints/last.ckpt)")
    try:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (non-zip) torch file cannot be memory-mapped
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file: the cause goes in the message
        raise ValueError(f"{field}={path} is not a moe-lab checkpoint (torch cannot read it: "
                         f"{type(err).__name__}). Use <run dir>/checkpoints/last.ckpt of a task=finetune run, "
                         "or task.resume=<run dir>.") from None
    hparams = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    if not isinstance(hparams, dict) or "method" not in hparams or "state_dict" not in ckpt:
        raise ValueError(f"{field}={path} is not a moe-lab checkpoint (no Lightning state_dict with moe-lab "
                         "hyperparameters). Use <run dir>/checkpoints/last.ckpt of a task=finetune run.")
    return ckpt


def checkpoint_label(ckpt: dict, path: Path) -> str:
    """``"<model> / <method>"`` of the run that wrote ``ckpt`` (stored in it, else its run's config.yaml)."""
    info = ckpt.get("moe_lab") or {}
    model = info.get("model")
    if model is None:
        config = Path(path).parent.parent / "config.yaml"
        if config.is_file():
            from omegaconf import OmegaConf

            model = OmegaConf.select(OmegaConf.load(config), "model.name")
    return f"{model or 'another model'} / {ckpt['hyper_parameters'].get('name') or ckpt['hyper_parameters']['method']}"


def check_matches(ckpt: dict, path: Path, module: torch.nn.Module, config_label: str,
                  field: str = "task.ckpt_path") -> None:
    """Refuse a checkpoint whose weights do not fit ``module`` (another model or method), naming both."""
    theirs = {k: tuple(v.shape) for k, v in ckpt["state_dict"].items()}
    ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    if theirs != ours:
        missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        shapes = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
        detail = "; ".join(f"{what}: {keys[0]}" + (f" (+{len(keys) - 1} more)" if len(keys) > 1 else "")
                           for what, keys in (("missing", missing), ("unexpected", extra),
                                              ("other shape", shapes)) if keys)
        raise ValueError(f"{field}={path}: the checkpoint is {checkpoint_label(ckpt, path)}, the config is "
                         f"{config_label} ({detail}). Resume with the run's own config: "
                         "task.resume=<run dir> (it re-applies that run's overrides).")


class CheckpointOnSignal(Callback):
    """SIGINT (Ctrl-C), SIGTERM and SIGUSR1 (a scheduler's warning) stop training after the current optimizer
    step and write ``ckpt_path`` before the process exits; a second Ctrl-C aborts at once.

    Lightning already turns SIGTERM into a ``SIGTERMException`` at the end of a training step (synchronised
    across DDP ranks); SIGINT and SIGUSR1 are routed to its handler. In one process the checkpoint is written in
    ``on_train_batch_end``, where ``ModelCheckpoint`` writes its own (so a resume logs at the same steps as an
    uninterrupted run); otherwise, and under DDP (all ranks stop together), in ``on_exception``. ``signum`` is
    the signal received (None: none).
    """

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")

    def __init__(self, ckpt_path: str | Path):
        self.ckpt_path = Path(ckpt_path)
        self.signum: int | None = None
        self.saved: Path | None = None
        self._lightning_handler = None

    def on_train_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._lightning_handler = signal.getsignal(signal.SIGTERM)  # installed by the Trainer for this fit
        for name in self.SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: stop now, without a checkpoint
            return
        self.signum = signum
        if self.ckpt_path is not None:
            print(f"\n{signal.Signals(signum).name} received: finishing this step, then writing "
                  f"{self.ckpt_path} (press Ctrl-C again to abort without it)", file=sys.stderr, flush=True)
        if callable(self._lightning_handler):
            self._lightning_handler(signal.SIGTERM, frame)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.signum is not None and self.saved is None and trainer.world_size == 1:
            trainer.save_checkpoint(self.ckpt_path)
            self.saved = self.ckpt_path

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, SIGTERMException) and self.signum is not None and self.saved is None:
            trainer.save_checkpoint(self.ckpt_path)
            self.saved = self.ckpt_path
