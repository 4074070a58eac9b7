"""A run stopped by a signal and resumed from the checkpoint the signal wrote logs exactly what an uninterrupted
run logs: every ``train/loss`` step 0..N-1 and every ``val/loss`` step of the validation cadence, each once, and
ends with the same weights.

Oracle: the uninterrupted run's own metrics.csv and weights. The resumed run's metrics.csv is put together as
task=finetune does (:class:`moe_lab.runtime.resume.History` carries the rows logged before the checkpoint step).
Signals come at the moments that used to lose something: during the optimizer step a validation follows, inside
a validation, in the first micro-batch of a gradient-accumulation window, and (DDP) on one rank only.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from moe_lab.data.resumable import ResumableDataLoader
from moe_lab.methods.base import MoELightningModule
from moe_lab.runtime.checkpoint_io import CheckpointOnSignal
from moe_lab.runtime.resume import History
from tests.callbacks.conftest import random_batches
from tests.conftest import ROOT, build_tiny

STEPS, VAL_EVERY = 8, 3  # validation after optimizer steps 3 and 6: logged at steps 2 and 5


class _Signal(L.Callback):
    """Sends ``signum`` to this process once, in ``hook`` when ``trainer.global_step == step`` and the
    micro-batch index within the accumulation window is ``phase`` (on rank ``rank`` only, if given)."""

    def __init__(self, hook: str, step: int, phase: int = 0, signum: int = signal.SIGUSR1, rank: int | None = None):
        self.hook, self.step, self.phase, self.signum, self.rank, self.sent = hook, step, phase, signum, rank, False

    def _maybe(self, trainer, hook):
        window = trainer.accumulate_grad_batches
        ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        if hook == self.hook and not self.sent and trainer.global_step == self.step and ready % window == self.phase:
            self.sent = True
            os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, trainer, *args):
        self._maybe(trainer, "train")

    def on_validation_batch_end(self, trainer, *args):
        if not trainer.sanity_checking:
            self._maybe(trainer, "val")


def _fit(run: Path, callbacks=(), ckpt: Path | None = None, accumulate: int = 1):
    """Train the tiny OLMoE for STEPS optimizer steps with a CSV logger in ``run`` (resumed from ``ckpt`` with
    the earlier rows carried over, as task=finetune does). Returns (module, interrupted)."""
    L.seed_everything(0)
    module = MoELightningModule(build_tiny("olmoe"), "sft", optim={"lr": 1e-2})
    logger = CSVLogger(run, name="", version="")
    logger.experiment  # noqa: B018 - create the writer before the earlier rows go in, as finetune does
    step = int(torch.load(ckpt, weights_only=True)["global_step"]) if ckpt else 0
    History(ckpt, step, run).replay([logger])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        accumulate_grad_batches=accumulate, val_check_interval=VAL_EVERY * accumulate,
                        check_val_every_n_epoch=None, limit_val_batches=3, num_sanity_val_steps=0,
                        callbacks=list(callbacks))
    train = ResumableDataLoader(random_batches(STEPS * accumulate + 4), batch_size=None, shuffle=False)
    val = torch.utils.data.DataLoader(random_batches(3, seed=7), batch_size=None)
    try:
        trainer.fit(module, train, val, ckpt_path=ckpt)
    except SIGTERMException:
        return module, True
    return module, False


def _steps(run: Path, column: str) -> list[int]:
    with open(run / "metrics.csv", newline="") as f:
        return sorted(int(row["step"]) for row in csv.DictReader(f) if row.get(column))


def _straight(tmp_path_factory, accumulate):
    run = tmp_path_factory.mktemp(f"straight{accumulate}")
    module, interrupted = _fit(run, accumulate=accumulate)
    assert not interrupted
    assert _steps(run, "train/loss") == list(range(STEPS)) and _steps(run, "val/loss") == [2, 5]
    return run, {k: v.clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return {1: _straight(tmp_path_factory, 1), 2: _straight(tmp_path_factory, 2)}


@pytest.mark.parametrize("hook,step,phase,accumulate", [
    ("train", 3, 0, 1),  # during optimizer step 3, which a validation follows
    ("val", 3, 0, 1),    # inside that validation
    ("train", 2, 0, 1),  # a step without validation
    ("train", 2, 1, 2),  # first micro-batch of a 2-batch accumulation window
], ids=["before-validation", "inside-validation", "plain-step", "mid-accumulation"])
def test_resumed_run_logs_every_step_once_and_ends_with_the_same_weights(tmp_path, straight, hook, step, phase,
                                                                           accumulate):
    first, second = tmp_path / "first", tmp_path / "second"
    on_signal = CheckpointOnSignal(first / "checkpoints" / "last.ckpt")
    _, interrupted = _fit(first, [_Signal(hook, step, phase), on_signal], accumulate=accumulate)
    assert interrupted and on_signal.saved is not None and on_signal.signum == signal.SIGUSR1
    ckpt_step = torch.load(on_signal.saved, weights_only=True)["global_step"]
    assert ckpt_step < STEPS
    resumed, interrupted = _fit(second, ckpt=on_signal.saved, accumulate=accumulate)
    assert not interrupted
    run, weights = straight[accumulate]
    for column in ("train/loss", "val/loss"):
        assert _steps(second, column) == _steps(run, column), column  # no gap, no duplicate
    for key, value in weights.items():
        assert torch.equal(resumed.state_dict()[key], value), key


def _run_py(run: Path, *overrides) -> int:
    """task=finetune on 2 gloo DDP processes, 6 steps, validation (3 batches) after steps 3 and 6."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = ["debug=fast", "hardware=ddp_cpu", "callbacks=none", "task.trainer.max_steps=6",
            "task.trainer.limit_val_batches=3", "task.checkpoint_every_n_steps=6", "task.export=false",
            f"hydra.run.dir={run}", *overrides]
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=run.parent, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode in (0, 128 + signal.SIGUSR1), proc.stderr[-4000:]
    return proc.returncode


@pytest.mark.slow
def test_ddp_signal_on_one_rank_inside_validation(tmp_path):
    """task=finetune under DDP, SIGUSR1 delivered to rank 1 only, inside the validation after step 3: both ranks
    stop at the same step, and the resumed run's metrics.csv and final weights equal the uninterrupted run's."""
    straight, first, second = tmp_path / "straight", tmp_path / "first", tmp_path / "second"
    assert _run_py(straight) == 0
    signal_rank1 = ["+callbacks.sig._target_=tests.runtime.test_signal_resume_logging._Signal", "+callbacks.sig.hook=val",
                    "+callbacks.sig.step=3", "+callbacks.sig.rank=1"]
    assert _run_py(first, *signal_rank1) == 128 + signal.SIGUSR1
    assert torch.load(first / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert _run_py(second, f"task.ckpt_path={first / 'checkpoints' / 'last.ckpt'}") == 0
    for column in ("train/loss", "val/loss"):
        assert _steps(second, column) == _steps(straight, column) == ([2, 5] if column == "val/loss" else
                                                                      list(range(6))), column
    want = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    got = torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
