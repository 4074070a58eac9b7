"""A finetune killed (SIGKILL) twice and resumed with ``task.resume`` each time writes what an uninterrupted run
writes (issue 21 items 4, 14, 27): metrics.csv row for row and cell for cell, the expert-load heatmaps, the
router-bias trajectory (CSV and plot, from step 0, with the step the condensers were chosen), the routing log and
the loss plot.

The kills: at step 3 (last checkpoint: step 2; the load window, the heatmap window and the drift probe straddle
it, the condensers are chosen after 2 bias updates), and after the last checkpoint (step 4) but before Lightning's
end of training (on_train_end). The second resume trains nothing and must find nothing missing. Oracle: the same
command run uninterrupted.
"""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from moe_lab.runtime.resume import History
from tests.test_run import run_py

STEPS = 4
COMMON = ("debug=fast", "method=condenser", "method.options.selection=in_run", "method.options.selection_updates=2",
          "callbacks=routing_log", f"task.trainer.max_steps={STEPS}", "task.checkpoint_every_n_steps=2",
          "callbacks.expert_load.log_every_n_steps=3", "callbacks.expert_load.heatmap_every_n_steps=3",
          "callbacks.routing_drift.every_n_steps=3", "callbacks.router_bias.log_every_n_steps=1",
          "callbacks.router_bias.plot_every_n_steps=0", "task.export=false",
          "dataset.batch_size=4")
#: files of the run that must equal the uninterrupted run's byte for byte (metrics.csv is compared by rows first)
FILES = ("metrics.csv", "routing_log.jsonl", "plots/router_bias_trajectory.csv", "plots/router_bias_trajectory.png",
         "plots/expert_load_step000003.png", "plots/expert_load_step000004.png", "plots/expert_load_latest.png",
         "plots/train_loss.png", "condenser.json")


class Kill(L.Callback):
    """SIGKILL this process at optimizer ``step``: in ``on_train_batch_end`` (after the checkpoint of an earlier
    step), or, at ``max_steps``, in ``on_train_epoch_end`` (after the last checkpoint, before ``on_train_end``)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step < trainer.max_steps:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_epoch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if v} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_killed_twice_and_resumed_the_run_writes_what_an_uninterrupted_one_does(tmp_path):
    straight, run = tmp_path / "straight", tmp_path / "run"
    run_py(*COMMON, f"hydra.run.dir={straight}", cwd=tmp_path)
    kill = ["+callbacks.kill._target_=tests.runtime.test_resume_history.Kill"]
    proc = run_py(*COMMON, *kill, "+callbacks.kill.step=3", f"hydra.run.dir={run}", cwd=tmp_path, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    proc = run_py(f"task.resume={run}", f"+callbacks.kill.step={STEPS}", cwd=tmp_path, check=False)  # wins
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    proc = run_py(f"task.resume={run}", "+callbacks.kill.step=-1", cwd=tmp_path)  # trains nothing
    assert "nothing is trained" in proc.stdout + proc.stderr

    want, got = _rows(straight / "metrics.csv"), _rows(run / "metrics.csv")
    columns = {k for row in want for k in row}
    assert {"load/gini_mean", "drift/kl_mean", "router_bias/norm", "epoch", "train/loss"} <= columns
    assert not [c for c in columns if "time" in c]  # no timing column: every cell must be equal
    assert [r.get("step") for r in got] == [r.get("step") for r in want]
    for row, (a, b) in enumerate(zip(want, got)):
        assert a == b, (row, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)})
    trajectory = (run / "plots" / "router_bias_trajectory.csv").read_text()
    assert trajectory.splitlines()[1].startswith("0,") and ",1," in trajectory  # from step 0, condensers marked
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(p.name for p in (straight / "plots").iterdir())
    for name in FILES:
        assert (run / name).read_bytes() == (straight / name).read_bytes(), name


def test_carried_rows_are_written_back_as_they_were(tmp_path):
    """The rows a resume carries into the new metrics.csv are the old file's text: ``epoch`` stays ``0`` (it was
    written back as ``0.0``), floats round-trip."""
    old, new = tmp_path / "old", tmp_path / "new"
    logger = CSVLogger(old, name="", version="")
    rows = [{"epoch": 0, "train/loss": 5.967193126678467, "train/tokens": 2844.0},
            {"epoch": 1, "val/ppl": 308.6605529785156, "lr": 3.0000000000000004e-4}]
    for step, row in enumerate(rows):
        logger.log_metrics(row, step=step)
    logger.log_metrics({"train/loss": 1.0}, step=2)  # at the checkpoint's step: not carried
    logger.save()
    resumed = CSVLogger(new, name="", version="")
    resumed.experiment  # noqa: B018 - the writer exists before the rows go in, as in task=finetune
    History(old / "checkpoints" / "last.ckpt", 2, new).replay([resumed])
    assert (new / "metrics.csv").read_text().splitlines() == (old / "metrics.csv").read_text().splitlines()[:3]
