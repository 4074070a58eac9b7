"""Resuming a finished task=finetune run with larger limits: more steps are trained (bit-exact against an
uninterrupted run), a resume that could train nothing is refused (epochs done) or logged (limits reached)."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import ROOT

COMMON = ["logger=none", "callbacks=none", "task.export=false", "dataset.num_examples=12", "dataset.batch_size=2",
          "dataset.val_fraction=0", "task.trainer.limit_val_batches=0", "task.trainer.val_check_interval=null",
          # a schedule that does not depend on the run's length, so 3 + 3 steps can equal 6 steps exactly
          "task.scheduler.name=constant", "task.scheduler.warmup_steps=0"]


def _run(out, *overrides) -> dict:
    from hydra import compose, initialize_config_dir

    from moe_lab.tasks import run_task

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.output_dir={out}", *COMMON, *overrides])
    return run_task(cfg)


def _weights(run) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.parametrize("max_epochs", [1, -1])
def test_larger_max_steps_continues_a_finished_run_exactly(tmp_path, caplog, max_epochs):
    """Oracle: one uninterrupted 6-step run (one epoch of 6 batches). A 3-step run resumed with max_steps=6 continues
    the same epoch (before: its end-of-training checkpoint recorded the epoch as done, so with max_epochs=1 it
    trained 0 more steps, and otherwise started a new epoch on other batches) and ends with the same weights."""
    epochs = f"task.trainer.max_epochs={max_epochs}"
    straight = _run(tmp_path / "straight", "task.trainer.max_steps=6", epochs)
    first = _run(tmp_path / "run", "task.trainer.max_steps=3", epochs)
    assert first["global_step"] == 3 and straight["global_step"] == 6
    with caplog.at_level(logging.WARNING, logger="moe_lab.runtime.resume"):
        extended = _run(tmp_path / "run", "task.trainer.max_steps=6", epochs, f"task.resume={tmp_path / 'run'}")
    assert (extended["resumed_from_step"], extended["global_step"]) == (3, 6)
    assert not [r for r in caplog.records if "nothing is trained" in r.getMessage()]
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a resume at the end of the run trains nothing, and says so (the warning names the fix)
    with caplog.at_level(logging.WARNING, logger="moe_lab.runtime.resume"):
        again = _run(tmp_path / "run", "task.trainer.max_steps=6", epochs, f"task.resume={tmp_path / 'run'}")
    assert (again["resumed_from_step"], again["global_step"]) == (6, 6)
    [record] = [r for r in caplog.records if "nothing is trained" in r.getMessage()]
    assert "step 6" in record.getMessage() and "larger task.trainer.max_steps" in record.getMessage()


def test_more_steps_after_the_last_epoch_is_refused_then_extended_as_told(tmp_path):
    """A one-epoch run (6 batches) asked for max_steps=8 would stop at once (max_epochs reached): refused with the
    fix; with that fix (max_epochs=-1) it trains to step 8."""
    epoch = ["task.trainer.max_epochs=1", "task.trainer.max_steps=-1"]
    first = _run(tmp_path / "run", *epoch)
    assert first["global_step"] == 6
    with pytest.raises(ValueError, match=r"task.resume: the checkpoint is at step 6 after 1 epoch\(s\) = "
                                         r"task.trainer.max_epochs=1.*0 more steps.*task.trainer.max_epochs=-1"):
        _run(tmp_path / "run", *epoch, "task.trainer.max_steps=8", f"task.resume={tmp_path / 'run'}")
    extended = _run(tmp_path / "run", "task.trainer.max_epochs=-1", "task.trainer.max_steps=8",
                    f"task.resume={tmp_path / 'run'}")
    assert (extended["resumed_from_step"], extended["global_step"]) == (6, 8)
