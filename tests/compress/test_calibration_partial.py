"""A calibration's partial file (issue 32 items 9, 12): a truncated one of the run's own is deleted and the
calibration restarts (one line; before, both suggested fixes reused the damaged partial), one given by
compress.calibration.resume_from is refused saying to delete it; a partial of another model says whose it is."""

from __future__ import annotations

import logging

import pytest
import torch

from moe_lab.compress.calibration import Calibration, calibrate
from tests.compress.test_calibration import _compose
from tests.conftest import build_tiny, random_batch, word_text


def _args(tmp_path):
    text = word_text(tmp_path / "wiki.train.txt", 30)
    return ["model=tiny_mixtral", f"compress.calibration.dataset.path={text}", "compress.calibration.num_sequences=5",
            "compress.calibration.seq_len=16", "compress.calibration.batch_size=2"]


def test_a_truncated_partial_of_the_run_is_deleted_and_the_calibration_restarts(tmp_path, caplog):
    """Oracle: the same calibration into a fresh directory."""
    from moe_lab.tasks import run_task

    whole = Calibration.load(run_task(_compose(tmp_path / "whole", *_args(tmp_path)))["calibration"])
    run = tmp_path / "run"
    run.mkdir()
    whole.save(run / "calibration.partial.safetensors")
    data = (run / "calibration.partial.safetensors").read_bytes()
    (run / "calibration.partial.safetensors").write_bytes(data[: len(data) // 2])  # the kill's leftover
    with caplog.at_level(logging.WARNING, logger="moe_lab.runs.calibrate"):
        again = Calibration.load(run_task(_compose(run, *_args(tmp_path)))["calibration"])
    [line] = [r.getMessage() for r in caplog.records if r.name == "moe_lab.runs.calibrate"]
    assert f"{run / 'calibration.partial.safetensors'} is truncated or corrupted" in line
    assert "deleted, the calibration restarts from the first batch" in line
    assert again.manifest == whole.manifest
    assert all(torch.equal(again.layers[i][k], v) for i, st in whole.layers.items() for k, v in st.items())


def test_a_truncated_partial_given_by_resume_from_is_refused_saying_to_delete_it(tmp_path):
    model = build_tiny("gpt_oss")
    partial = tmp_path / "partial.safetensors"
    calibrate(model, [random_batch(seed=s) for s in range(2)], data_source="unit").save(partial)
    partial.write_bytes(partial.read_bytes()[:100])
    with pytest.raises(ValueError) as err:
        calibrate(model, [random_batch(seed=s) for s in range(2)], resume_from=partial)
    msg = str(err.value)
    assert f"compress.calibration.resume_from={partial}: the file is truncated or corrupted" in msg
    assert f"It cannot be continued: delete {partial} and drop compress.calibration.resume_from" in msg
    assert "resume_from=" + str(partial) + " " not in msg.split("It cannot")[1]  # not offered again


def test_a_partial_of_another_model_says_whose_it_is_and_the_fix(tmp_path):
    """Before: 'recalibrate this model with task=calibrate', the command just run, and no owner."""
    partial = tmp_path / "partial.safetensors"
    calibrate(build_tiny("gpt_oss"), [random_batch()], data_source="unit",
              manifest_extra={"model_config": "tiny_gpt_oss"}).save(partial)
    with pytest.raises(ValueError) as err:
        calibrate(build_tiny("qwen3_moe"), [random_batch()], resume_from=partial, data_source="unit")
    msg = str(err.value)
    assert f"the partial calibration {partial} (it belongs to model tiny_gpt_oss) is for" in msg
    assert f"continue it with model=tiny_gpt_oss, or delete {partial}" in msg and "task=calibrate" not in msg


def test_task_resume_of_a_finished_calibration_says_it_calibrates_again(tmp_path, caplog):
    """task.resume of a calibrate run that finished (no partial file left) computes it again, saying so in one line."""
    from moe_lab.tasks import run_task

    run = tmp_path / "run"
    run_task(_compose(run, *_args(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="moe_lab.runs.calibrate"):
        run_task(_compose(run, *_args(tmp_path), f"task.resume={run}"))
    [line] = [r.getMessage() for r in caplog.records if r.name == "moe_lab.runs.calibrate"]
    assert line == (f"task.resume: this run's calibration finished ({run / 'summary.json'}) and left no partial file: "
                    "it is computed again from the first batch")


@pytest.mark.slow
def test_run_py_task_resume_continues_a_calibrate_run_in_its_directory(tmp_path):
    """``python run.py task.resume=<run dir>`` on a task=calibrate run, as a user types it: the run's own overrides are
    re-applied in its directory (no other), and the finished calibration is said to be computed again."""
    from tests.test_run import run_py

    run = tmp_path / "run"
    run_py("task=calibrate", *_args(tmp_path), f"hydra.run.dir={run}", cwd=tmp_path)
    first = Calibration.load(run / "calibration.safetensors")
    proc = run_py(f"task.resume={run}", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert f"Output directory: {run}" in out and "task.resume: the run's settings are conf/ with the overrides" in out
    assert "this run's calibration finished" in out
    again = Calibration.load(run / "calibration.safetensors")
    assert again.manifest == first.manifest and sorted(p.name for p in tmp_path.iterdir()) == ["run", "wiki.train.txt"]
