"""A run directory is one run (issue 21): the same command again is refused naming task.resume, a second live run
is refused naming the first's PID and host (a dead one's lock taken over), and a resume that would change the
trajectory (dataset, method, batch size, world size, accumulation) is refused unless allowed, each change one line."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.runtime.checkpoint_io import CheckpointOnSignal, content_digests, marker_path, read_checkpoint
from moe_lab.runtime.resume import resume_checkpoint
from moe_lab.runtime.run_lock import LOCK_FILE, RunLock
from tests.conftest import ROOT
from tests.runtime.test_resume_extend import _run

STEPS = ["task.trainer.max_steps=2", "task.checkpoint_every_n_steps=1"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One 2-step run (batch size 2, sft), checkpoints at each step."""
    out = tmp_path_factory.mktemp("guard") / "run"
    _run(out, *STEPS)
    return out


def _snapshot(run):
    return {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_same_command_into_a_resumable_run_is_refused_naming_task_resume(finished):
    before = _snapshot(finished)
    with pytest.raises(ValueError) as err:
        _run(finished, *STEPS)
    msg = str(err.value)
    assert f"{finished} already holds a run" in msg and "step 2" in msg and f"task.resume={finished}" in msg
    assert _snapshot(finished) == before  # no checkpoint, metric or lock file touched


@pytest.mark.parametrize(("override", "change"), [
    ("dataset.batch_size=4", "dataset.batch_size: 2 -> 4"),
    ("dataset.num_examples=16", "dataset.num_examples: 12 -> 16"),
    ("task.trainer.accumulate_grad_batches=2", "task.trainer.accumulate_grad_batches: 1 -> 2"),
    ("method=sft_aux_free", "method.name: sft -> sft_aux_free"),
])
def test_resume_that_changes_the_trajectory_is_refused(finished, override, change):
    before = _snapshot(finished)
    with pytest.raises(ValueError) as err:
        _run(finished, *STEPS, "task.trainer.max_steps=3", f"task.resume={finished}", override)
    msg = str(err.value)
    assert change in msg and "task.allow_resume_changes=true" in msg and "task.resume" in msg
    assert _snapshot(finished) == before


def test_frozen_router_on_an_sft_run_is_refused_naming_both(finished):
    with pytest.raises(ValueError, match=r"method.name: sft -> frozen_router"):
        _run(finished, *STEPS, f"task.resume={finished}", "method=frozen_router")
    # allowed, it still cannot restore sft's optimizer state for other trainable parameters: refused, naming both,
    # before any file of the run changes
    before = _snapshot(finished)
    with pytest.raises(ValueError, match=r"method=frozen_router.*sft.*optimizer state"):
        _run(finished, *STEPS, f"task.resume={finished}", "method=frozen_router", "task.allow_resume_changes=true")
    assert _snapshot(finished) == before


def test_world_size_recorded_in_the_checkpoint_is_checked(tmp_path):
    out = tmp_path / "run"
    _run(out, *STEPS)
    ckpt = out / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    state["moe_lab"]["run"]["world size"] = 2  # as a 2-rank DDP run writes it
    torch.save(state, ckpt)
    info = json.loads(marker_path(ckpt).read_text())
    marker_path(ckpt).write_text(json.dumps({**info, "world_size": 2, "sha256": content_digests(ckpt)}))
    with pytest.raises(ValueError, match=r"world size: 2 -> 1"):
        _run(out, *STEPS, "task.trainer.max_steps=3", f"task.resume={out}")


def test_allowed_changes_and_checkpoint_of_another_config_say_each_change_in_one_line(finished, tmp_path, caplog):
    """Issue 21.2: task.ckpt_path=<file> with other settings (lr, max_steps) continues, one line per change."""
    with caplog.at_level(logging.WARNING, logger="moe_lab.runtime.resume"):
        summary = _run(tmp_path / "new", "task.trainer.max_steps=3", "task.optim.lr=1e-3",
                       f"task.ckpt_path={finished / 'checkpoints' / 'last.ckpt'}")
    assert summary["global_step"] == 3
    lines = [r.getMessage() for r in caplog.records if "differs from the checkpoint's run" in r.getMessage()]
    assert any("task.optim.lr: 0.003 -> 0.001" in line for line in lines)
    assert any("task.trainer.max_steps: 2 -> 3" in line for line in lines)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moe_lab.runtime.resume"):
        _run(tmp_path / "other", "task.trainer.max_steps=3", "dataset.batch_size=4", "task.allow_resume_changes=true",
             f"task.ckpt_path={finished / 'checkpoints' / 'last.ckpt'}")
    assert [r.getMessage() for r in caplog.records if "dataset.batch_size: 2 -> 4" in r.getMessage()]


# ---- the run lock (issue 21.11) -----------------------------------------------------------------------------
def test_a_live_run_holds_the_directory(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname()}))
        with pytest.raises(RuntimeError) as err:
            RunLock(tmp_path).acquire()
        assert f"PID {other.pid} on host {socket.gethostname()}" in str(err.value)
        with pytest.raises(RuntimeError, match=f"PID {other.pid}"):  # what task=finetune does first
            _run(tmp_path, *STEPS)
        assert not (tmp_path / "checkpoints").exists()
    finally:
        other.kill()
        other.wait()


def test_a_stale_lock_on_this_host_is_taken_over_in_one_line(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    with caplog.at_level(logging.WARNING, logger="moe_lab.runtime.run_lock"), RunLock(tmp_path):
        held = json.loads((tmp_path / LOCK_FILE).read_text())
        assert held["pid"] == os.getpid()
    [line] = [r.getMessage() for r in caplog.records]
    assert f"PID {dead.pid}" in line and "no longer running" in line
    assert not (tmp_path / LOCK_FILE).exists()  # released


def test_a_lock_of_another_host_is_refused_with_the_way_out(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1234, "host": "elsewhere"}))
    with pytest.raises(RuntimeError) as err:
        RunLock(tmp_path).acquire()
    assert "PID 1234 on host elsewhere" in str(err.value) and str(tmp_path / LOCK_FILE) in str(err.value)


def test_taking_the_lock_again_in_the_process_that_holds_it_is_a_no_op(tmp_path):
    """A task holds its directory (run_task) and runs finetune there (cd_moe_sft): the inner lock neither refuses
    nor releases the outer one."""
    with RunLock(tmp_path) as outer:
        with RunLock(tmp_path) as inner:
            assert outer.held and not inner.held
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()


def _teacher_logits_cfg(tmp_path, out):
    from tests.distill.test_teacher_logits_task import _cfg

    return _cfg(tmp_path, "task=teacher_logits", f"paths.output_dir={out}")


@contextlib.contextmanager
def _held_by_a_live_process(folder):
    """``folder`` locked by a live process on this host (a sleeping child, killed on exit); yields its PID."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder.mkdir(exist_ok=True)
        (folder / LOCK_FILE).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname()}))
        yield other.pid
    finally:
        other.kill()
        other.wait()


def test_every_task_removes_the_temporaries_a_killed_run_left(tmp_path, caplog):
    """task=teacher_logits (no checkpoint of its own) killed between the record's write and its rename left
    ``.teacher_logits.safetensors.<random>.tmp``: the next run into the directory removes it, in one line naming it.
    A temporary inside the folder of another live run (its lock) is left alone."""
    from moe_lab.tasks import run_task

    out = tmp_path / "rec"
    out.mkdir()
    stale = out / ".teacher_logits.safetensors.k2j3.tmp"
    stale.write_bytes(b"half a record")
    with _held_by_a_live_process(out / "live"):
        (out / "live" / ".summary.json.a1b2.tmp").write_text("{")
        with caplog.at_level(logging.INFO, logger="moe_lab.core.atomic"):
            summary = run_task(_teacher_logits_cfg(tmp_path, out))
    assert not stale.exists() and (out / "live" / ".summary.json.a1b2.tmp").exists()
    [line] = [r.getMessage() for r in caplog.records if "partial files" in r.getMessage()]
    assert line == (f"removed 1 partial files of an earlier run killed while writing in {out}: "
                    ".teacher_logits.safetensors.k2j3.tmp")
    assert summary["file"] == str(out / "teacher_logits.safetensors") and not (out / LOCK_FILE).exists()


def test_a_live_run_keeps_its_temporaries(tmp_path):
    """The same directory held by a live process: the task is refused naming it; its temporary stays."""
    from moe_lab.tasks import run_task

    out = tmp_path / "rec"
    out.mkdir()
    writing = out / ".teacher_logits.safetensors.k2j3.tmp"
    writing.write_bytes(b"being written")
    with _held_by_a_live_process(out) as pid, pytest.raises(RuntimeError, match=f"PID {pid}"):
        run_task(_teacher_logits_cfg(tmp_path, out))
    assert writing.read_bytes() == b"being written" and not (out / "teacher_logits.safetensors").exists()


# ---- through run.py: a refused command changes nothing of the run's own files (issue 21.9, 21.3, 21.24) ------------
@pytest.mark.slow
def test_refused_commands_leave_the_run_files_and_the_plain_resume_works(tmp_path):
    from tests.test_run import run_py

    out = tmp_path / "run"
    common = ["logger=none", "callbacks=none", "task.export=false", "dataset.num_examples=12", "dataset.batch_size=2",
              "dataset.val_fraction=0", "task.trainer.limit_val_batches=0", "task.trainer.val_check_interval=null",
              *STEPS]
    run_py(*common, f"hydra.run.dir={out}", cwd=tmp_path)
    files = [out / ".hydra" / "overrides.yaml", out / ".hydra" / "config.yaml", out / "config.yaml"]
    before = [f.read_bytes() for f in files]
    for refused, says in [
        ([*common, "task.optim.lr=1e-3", f"hydra.run.dir={out}"], f"task.resume={out}"),  # the same dir again
        ([f"task.resume={out}", "method=frozen_router"], "method.name: sft -> frozen_router"),
    ]:
        proc = run_py(*refused, cwd=tmp_path, check=False)
        assert proc.returncode != 0 and says in proc.stderr, proc.stderr[-2000:]
        assert [f.read_bytes() for f in files] == before, refused
    proc = run_py(f"task.resume={out}", "task.trainer.max_steps=3", cwd=tmp_path)
    assert json.loads((out / "summary.json").read_text())["global_step"] == 3
    assert f"overrides of {out / '.hydra' / 'overrides.yaml'}" in proc.stdout + proc.stderr  # which file it reads
    assert "an edit there is not applied" in (out / "run.log").read_text()
    assert "task.trainer.max_steps=3" in (out / ".hydra" / "overrides.yaml").read_text()  # accepted: recorded
    typo = run_py(f"task.resume={tmp_path / 'rnu'}", cwd=tmp_path, check=False)
    assert typo.returncode != 0 and f"task.resume={tmp_path / 'rnu'}: no such run directory" in typo.stderr
    assert not (tmp_path / "rnu").exists()


def test_resume_of_a_missing_or_copied_run_dir_is_refused_before_hydra_runs(tmp_path):
    """Issue 21.24: a typo is not created as a new directory; a copy without .hydra/ would resume with the default
    config."""
    import run

    with pytest.raises(ValueError, match=f"task.resume={tmp_path / 'rnu'}: no such run directory"):
        run.expand_argv(["run.py", f"task.resume={tmp_path / 'rnu'}"])
    assert not (tmp_path / "rnu").exists()
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "config.yaml").write_text("seed: 1\n")
    with pytest.raises(ValueError, match=r"\.hydra/overrides.yaml is missing .*copy \.hydra/ too"):
        run.expand_argv(["run.py", f"task.resume={tmp_path / 'copy'}"])


def test_resume_by_a_deepspeed_checkpoint_directory_runs_in_its_run_dir(tmp_path):
    """The hint names task.resume=<run dir>/checkpoints/step-N.ckpt, a directory under DeepSpeed."""
    import run

    ckpt = tmp_path / "checkpoints" / "step-4.ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step4")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- seed=3\n")
    args = run.expand_argv(["run.py", f"task.resume={ckpt}"])
    assert args[1:] == ["seed=3", f"task.resume={ckpt}", f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    cfg = OmegaConf.create({"task": {"resume": str(ckpt), "ckpt_path": None}})
    assert resume_checkpoint(cfg) == (ckpt, "task.resume")


class DoubleCtrlC(L.Callback):
    """Two SIGINTs at step 2, before its checkpoint: the second aborts (CheckpointOnSignal's own handler)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            handler = next(c for c in trainer.callbacks if isinstance(c, CheckpointOnSignal))
            handler._handle(signal.SIGINT, None)
            handler._handle(signal.SIGINT, None)


def test_a_second_ctrl_c_ends_as_an_interrupted_run_that_names_the_checkpoint_kept(tmp_path, capsys):
    """Issue 21.19: before, Lightning's exit(1) with no 'Resume with:' line."""
    from moe_lab.runtime.stop_signal import RunInterrupted

    out = tmp_path / "run"
    try:
        with pytest.raises(RunInterrupted) as err:
            _run(out, "task.trainer.max_steps=4", "task.checkpoint_every_n_steps=1",
                 "+callbacks.double._target_=tests.runtime.test_resume_guard.DoubleCtrlC")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores SIGINT after a KeyboardInterrupt
    assert err.value.code == 128 + signal.SIGINT
    assert "second Ctrl-C" in capsys.readouterr().err
    assert read_checkpoint(out / "checkpoints" / "last.ckpt")["global_step"] == 1
    assert not (out / LOCK_FILE).exists()


@pytest.mark.parametrize(("task", "says"), [
    ("teacher_logits", "it does not resume, run it again"),
    ("estimate", "it does not resume, run it again"),
    ("correlation", "it does not resume, run it again"),
])
def test_resume_of_a_run_of_another_kind_says_what_it_is_and_how_it_resumes(tmp_path, task, says):
    """Issue 21.25: before, Hydra's '+task.resume' hint or silently ignored (teacher_logits)."""
    import run

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(f"- task={task}\n")
    (tmp_path / "config.yaml").write_text(f"task:\n  name: {task}\n")
    with pytest.raises(ValueError) as err:
        run.expand_argv(["run.py", f"task.resume={tmp_path}"])
    assert f"{tmp_path} is a task={task} run" in str(err.value) and says in str(err.value)


@pytest.mark.parametrize("task", ["calibrate", "evaluate", "compress", "condense", "expert_removal", "moe_to_dense",
                                  "cd_moe_sft", "condenser_two_phase"])
def test_every_task_that_keeps_partial_work_resumes_with_task_resume(tmp_path, task):
    """Issue 30: one way to continue any run, ``task.resume=<run dir>``: the run's overrides re-applied, in its
    directory, where the task continues what it finished (its config declares task.resume)."""
    import run

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(f"- task={task}\n- model=tiny_olmoe\n")
    (tmp_path / "config.yaml").write_text(f"task:\n  name: {task}\n")
    args = run.expand_argv(["run.py", f"task.resume={tmp_path}"])
    assert args[1:4] == [f"task={task}", "model=tiny_olmoe", f"task.resume={tmp_path}"]
    assert f"hydra.run.dir={tmp_path}" in args
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        assert compose("config", overrides=args[1:4]).task.resume == str(tmp_path)


def test_resume_under_multirun_is_refused(tmp_path):
    """Issue 21.10: under -m, task.resume continued the checkpoint in a new sweep directory with the default config."""
    import run

    with pytest.raises(ValueError, match=r"task.resume does not work under -m .* without -m"):
        run.expand_argv(["run.py", "-m", f"task.resume={tmp_path}"])
