"""Nothing lost, round two (issue 32): each case interrupts or corrupts a run the way the fault campaign did, then
runs the same command again; the run's files must come out whole, or the command is refused naming the fix."""

from __future__ import annotations

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
    assert f"task.resume=docs: docs is not a moe-lab run directory" in proc.stderr, proc.stderr[-2000:]
    assert "nothing was written into it" in proc.stderr
    assert sorted(p.name for p in docs.iterdir()) == ["resume.md"]
