"""Nothing lost, round two (issue 32): each case interrupts or corrupts a run the way the fault campaign did, then
runs the same command again; the run's files must come out whole, or the command is refused naming the fix."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch

from moe_lab.runtime.checkpoint_io import check_resumable, marker_path
from tests.runtime.test_resume_guard import _held_by_a_live_process


def test_a_second_run_into_a_live_runs_directory_writes_nothing_there(tmp_path):
    """Two runs into one directory at the same instant: the live one (seed 7) holds the lock, its config.yaml
    written; the second (seed 42) was refused by the lock only after Hydra had written .hydra/ and run.py
    config.yaml (the live run's record then said seed 42). Now the lock comes first: nothing of it is written."""
    from tests.test_run import run_py

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("seed: 7\n")
    with _held_by_a_live_process(out) as pid:
        proc = run_py("debug=fast", "seed=42", f"hydra.run.dir={out}", cwd=tmp_path, check=False)
    assert proc.returncode != 0 and f"PID {pid}" in proc.stderr, proc.stderr[-2000:]
    assert (out / "config.yaml").read_text() == "seed: 7\n"
    assert not (out / ".hydra").exists()


def test_resume_of_a_folder_that_is_not_a_run_is_refused_and_writes_nothing(tmp_path):
    """Fresh-clone issue: task.resume=docs wrote .hydra/, config.yaml and run.log into the repository's docs/ and
    said 'the run wrote no checkpoint yet'."""
    from tests.test_run import run_py

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "resume.md").write_text("# Runs\n")
    proc = run_py("task.resume=docs", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "task.resume=docs: docs is not a moe-lab run directory" in proc.stderr, proc.stderr[-2000:]
    assert "nothing was written into it" in proc.stderr
    assert sorted(p.name for p in docs.iterdir()) == ["resume.md"]


# ---- a checkpoint and its marker (items 2, 3, 10) -----------------------------------------------------------------
class _Killed(Exception):
    """The kill -9 of the fault campaign, at one point of the save."""


def _fit(tmp_path, keep_last=0, max_steps=4, fail_marking_at=None):
    """tests/runtime/test_integrity's tiny fit; ``fail_marking_at``: the run is killed after that step's checkpoint
    file was renamed into place, before its COMPLETED marker was (mark_completed raises)."""
    from unittest import mock

    from moe_lab.runtime import checkpoint_io
    from tests.runtime.test_integrity import _fit as fit

    if fail_marking_at is None:
        return fit(tmp_path, keep_last=keep_last, max_steps=max_steps)
    real = checkpoint_io.mark_completed

    def killed(trainer, ckpt):
        if trainer.global_step == fail_marking_at:
            raise _Killed("killed between the renames")
        real(trainer, ckpt)

    with mock.patch.object(checkpoint_io, "mark_completed", killed), pytest.raises(_Killed):
        fit(tmp_path, keep_last=keep_last, max_steps=max_steps)


def _drop_hash(ckpt):
    info = json.loads(marker_path(ckpt).read_text())
    info.pop("sha256")
    marker_path(ckpt).write_text(json.dumps(info))


def test_a_marker_without_a_hash_cannot_vouch_for_a_corrupted_checkpoint(tmp_path):
    """Item 2: before, a marker without sha256 switched the integrity check off and a corrupted file trained on."""
    from tests.runtime.test_integrity import _flip_bytes

    _fit(tmp_path)
    ckpt = tmp_path / "last.ckpt"
    _drop_hash(ckpt)
    _flip_bytes(ckpt)
    with pytest.raises(ValueError) as err:
        check_resumable(ckpt, "task.resume", "single")
    assert "records no sha256" in str(err.value) and "task.adopt_checkpoint=true" in str(err.value)
    with pytest.raises(ValueError, match="does not match its CRC-32"):  # the zip records' own checksums
        check_resumable(ckpt, "task.resume", "single", adopt=True)


def test_a_kill_between_the_checkpoints_rename_and_its_markers_loses_nothing(tmp_path, caplog):
    """Item 3: killed after step 3's last.ckpt was renamed into place, before its marker: the old marker (step 2)
    no longer matched and the intact checkpoint was refused as corrupted, with no older one kept. The marker
    written before the rename vouches for it: adopted, in one line. Oracle: hashlib and torch.load of the file."""
    _fit(tmp_path, fail_marking_at=3)
    ckpt = tmp_path / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == 3
    assert json.loads(marker_path(ckpt).read_text())["global_step"] == 2  # the state the kill left
    with caplog.at_level(logging.WARNING, logger="moe_lab.runtime.marker_recovery"):
        check_resumable(ckpt, "task.resume", "single")
    info = json.loads(marker_path(ckpt).read_text())
    assert info["global_step"] == 3 and info["sha256"] == {"last.ckpt": hashlib.sha256(ckpt.read_bytes()).hexdigest()}
    [line] = [r.getMessage() for r in caplog.records if r.name == "moe_lab.runtime.marker_recovery"]
    assert f"task.resume={ckpt}" in line and "adopted (step 3)" in line
    assert not list(tmp_path.glob("*.PENDING"))
    check_resumable(ckpt, "task.resume", "single")  # now an ordinary marked checkpoint


def test_an_intact_checkpoint_whose_marker_was_deleted_is_adopted_on_request(tmp_path, caplog):
    """Item 10: before, called half-written with no option accepting it. task.adopt_checkpoint=true re-verifies
    it and writes a marker with its hash (oracle: hashlib); a corrupted one is not adopted."""
    _fit(tmp_path)
    assert not list(tmp_path.glob("*.PENDING"))  # a save that ends drops its pending marker
    ckpt = tmp_path / "last.ckpt"
    expected = json.loads(marker_path(ckpt).read_text())
    marker_path(ckpt).unlink()
    with pytest.raises(ValueError, match=r"or the marker was deleted.*task.adopt_checkpoint=true"):
        check_resumable(ckpt, "task.resume", "single")
    with caplog.at_level(logging.WARNING, logger="moe_lab.runtime.marker_recovery"):
        check_resumable(ckpt, "task.resume", "single", adopt=True)
    info = json.loads(marker_path(ckpt).read_text())
    assert {k: info[k] for k in expected} == expected and info["adopted"] is True
    [line] = [r.getMessage() for r in caplog.records if r.name == "moe_lab.runtime.marker_recovery"]
    assert "re-verified" in line and "adopted (task.adopt_checkpoint=true)" in line


# ---- a plain re-run into a run whose last.ckpt lost its marker (item 4) ------------------------------------------
def _snapshot(run):
    return {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_a_plain_rerun_beside_complete_step_checkpoints_is_refused_naming_the_newest(tmp_path):
    """Before: last.ckpt without its marker made the directory look new; the run restarted from step 0, wiped
    metrics.csv's history and went on to replace its step-<n>.ckpt."""
    from tests.runtime.test_resume_extend import _run

    out = tmp_path / "run"
    steps = ["task.trainer.max_steps=4", "task.checkpoint_every_n_steps=1", "task.keep_last_checkpoints=2"]
    _run(out, *steps)
    marker_path(out / "checkpoints" / "last.ckpt").unlink()
    before = _snapshot(out)
    with pytest.raises(ValueError) as err:
        _run(out, *steps)
    msg = str(err.value)
    assert f"{out} already holds a run's checkpoints (last.ckpt, step-2.ckpt, step-3.ckpt" in msg
    assert f"task.resume={out / 'checkpoints' / 'step-3.ckpt'}" in msg
    assert _snapshot(out) == before


# ---- metrics.csv cut mid-file (item 5) -----------------------------------------------------------------------------
def test_a_metrics_csv_cut_mid_line_loses_its_partial_line_and_says_so(tmp_path, caplog):
    """Before: the cut row was replayed with a shortened value (5.23 for 5.2345678) and nothing said the rows of
    the later steps were gone. Oracle: csv over the lines written before the cut."""
    import csv

    from moe_lab.runtime.resume import History

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    lines = ["epoch,step,train/loss\n", *[f"0,{i},{1.2345678 + i}\n" for i in range(8)]]
    (run / "metrics.csv").write_text("".join(lines[:5]) + lines[5][:8])  # cut inside step 4's loss
    with caplog.at_level(logging.WARNING, logger="moe_lab.runtime.resume"):
        history = History(run / "checkpoints" / "last.ckpt", 8, run)
    expected = [{"epoch": int(r["epoch"]), "train/loss": float(r["train/loss"]), "step": int(r["step"])}
                for r in csv.DictReader(lines[:5])]
    assert history.rows == expected
    [line] = [r.getMessage() for r in caplog.records if r.name == "moe_lab.runtime.resume"]
    assert "metrics.csv was cut mid-line" in line and "'0,4,5.23'" in line
    assert "end at step 3" in line and "up to the checkpoint's step 8 are lost" in line


# ---- which file a resume reads (item 11) ------------------------------------------------------------------------
def test_a_resume_says_which_file_it_reads_and_that_the_config_records_are_not(tmp_path):
    """Before: a hand edit of .hydra/config.yaml was ignored on resume without a word."""
    import run

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- seed=3\n- dataset.batch_size=2\n")
    (tmp_path / ".hydra" / "config.yaml").write_text("seed: 99\n")  # the hand edit
    run.expand_argv(["run.py", f"task.resume={tmp_path}", "task.trainer.max_steps=9"])
    note = run.RESUME_NOTE
    assert f"the overrides of {tmp_path / '.hydra' / 'overrides.yaml'} (2 re-applied" in note
    assert "given now: task.trainer.max_steps=9" in note
    assert f"{tmp_path / '.hydra' / 'config.yaml'} and {tmp_path / 'config.yaml'} are records" in note
    assert "an edit there is not applied" in note
    run.expand_argv(["run.py", "seed=1"])
    assert run.RESUME_NOTE is None
