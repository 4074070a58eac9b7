"""Training progress for people: a step bar on a terminal, one line every few steps in logs and CI.

``progress(every_n_steps)`` (the ``callbacks.progress`` entry) picks :class:`StepProgressBar` when stdout is a
terminal and :class:`ProgressLog` otherwise. Both count optimizer steps against ``max_steps`` (never
Lightning's "Epoch 0/-2" of an infinite epoch count) and show the latest ``train/loss`` and speed.
:class:`ProgressLog` also keeps the run's wall time across resumes (its state is in every checkpoint).
"""

from __future__ import annotations

import logging
import sys
import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, TQDMProgressBar

log = logging.getLogger("moe_lab.progress")


def _loss(trainer: pl.Trainer) -> float | None:
    value = trainer.callback_metrics.get("train/loss")
    return None if value is None else float(value)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar over optimizer steps (``global_step / max_steps``) with loss and it/s."""

    @property
    def train_description(self) -> str:
        return "train"

    def on_train_epoch_start(self, trainer: pl.Trainer, *_) -> None:
        bar = self.train_progress_bar
        if bar.total != trainer.max_steps:  # once per fit, not per epoch
            bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
            bar.initial = bar.n = trainer.global_step
            bar.set_description("train")

    def get_metrics(self, trainer: pl.Trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        loss = _loss(trainer)
        if loss is not None and "train/loss" not in metrics:
            metrics["train/loss"] = f"{loss:.3f}"
        return metrics

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        if bar is not None and trainer.global_step != bar.n:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module) -> None:
        pass  # one bar for the whole run


class ProgressLog(Callback):
    """A log line every ``every_n_steps`` optimizer steps: step, loss, it/s, elapsed and remaining time.

    ``every_n_steps=None`` picks about 20 lines per run; a line also comes when ``max_silence_s`` have passed
    since the last one (slow steps never leave the log silent for minutes); ``quiet`` logs nothing.
    ``wall_time_s`` is the run's total wall time, including the segments before a resume.
    """

    def __init__(self, every_n_steps: int | None = None, quiet: bool = False, max_silence_s: float = 60.0):
        if every_n_steps is not None and int(every_n_steps) <= 0:
            raise ValueError(f"callbacks.progress.every_n_steps={every_n_steps}: use a positive integer or null")
        self.every_n_steps = every_n_steps
        self.quiet = quiet
        self.max_silence_s = max_silence_s
        self.before_s = 0.0  # wall time of earlier segments (restored from the checkpoint)
        self._start = None
        self._window = None

    @property
    def this_run_s(self) -> float:
        return 0.0 if self._start is None else time.time() - self._start

    @property
    def wall_time_s(self) -> float:
        return self.before_s + self.this_run_s

    def state_dict(self) -> dict:
        return {"wall_time_s": self.wall_time_s}

    def load_state_dict(self, state_dict: dict) -> None:
        self.before_s = float(state_dict.get("wall_time_s", 0.0))

    def on_fit_start(self, trainer, pl_module) -> None:
        self._start = time.time()

    def on_train_start(self, trainer, pl_module) -> None:
        self._window = (time.time(), trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, total = trainer.global_step, trainer.max_steps
        every = self.every_n_steps or max(1, total // 20 if total > 0 else 50)
        now = time.time()
        due = step % every == 0 or step == total or now - self._window[0] >= self.max_silence_s
        if self.quiet or step == self._window[1] or not due or not trainer.is_global_zero:
            return
        rate = (step - self._window[1]) / max(now - self._window[0], 1e-9)
        self._window = (now, step)
        loss = _loss(trainer)
        parts = [f"step {step}/{total}" if total > 0 else f"step {step}"]
        if loss is not None:
            parts.append(f"train/loss {loss:.4f}")
        parts.append(f"{rate:.2f} it/s")
        parts.append(f"elapsed {_duration(self.wall_time_s)}")
        if total > 0 and rate > 0:
            parts.append(f"eta {_duration((total - step) / rate)}")
        log.info(" | ".join(parts))


def progress(every_n_steps: int | None = None, tty: bool | None = None, max_silence_s: float = 60.0) -> list[Callback]:
    """The progress callbacks for this console: a bar on a terminal, log lines otherwise (the
    :class:`ProgressLog` is always there: it keeps the wall time)."""
    tty = sys.stdout.isatty() if tty is None else tty
    return [StepProgressBar(), ProgressLog(quiet=True)] if tty else [ProgressLog(every_n_steps, max_silence_s=max_silence_s)]
