"""A new user's first hour, end to end through run.py: short runs, resume, Ctrl-C, grids, errors, console."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.test_run import run_py

NOISE = ("litlogger", "LeafSpec", "Setting accelerator to CPU", "Previous log files", "Writing model shards")


def _steps(path: Path, name: str = "train/loss") -> list[int]:
    with open(path) as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get(name)]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """3 steps, fewer than log_every_n_steps=5 and the validation interval (this used to crash the loss plot)."""
    tmp = tmp_path_factory.mktemp("short")
    out = tmp / "run"
    proc = run_py("model=tiny_qwen3_moe", "method=frozen_router", "task.trainer.max_steps=3",
                  "dataset.num_examples=64", f"hydra.run.dir={out}", cwd=tmp)
    return proc, out


def test_short_run_exports_plots_and_prints_a_summary(short_run):
    proc, out = short_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 3 and (out / "export" / "model.safetensors").is_file()
    assert _steps(out / "metrics.csv") == [2]  # logged at the last step although log_every_n_steps=5
    assert (out / "plots" / "train_loss.png").stat().st_size > 0
    console = proc.stdout + proc.stderr
    assert "step 3/3 | train/loss" in console and " it/s" in console
    block = console[console.index("==== moe-lab finetune: run finished ===="):]
    for line in ("model / method  tiny_qwen3_moe / frozen_router", "steps           3",
                 f"train/loss      {summary['train/loss']:.4f}", f"run directory   {out}",
                 f"export          {out / 'export'}", "train_loss.png", "train examples  "):
        assert line in block, line
    assert [n for n in NOISE if n in console] == []


def test_evaluate_names_its_directory_after_the_export_and_fails_when_nothing_ran(short_run, tmp_path):
    _, out = short_run
    proc = run_py("task=evaluate", "eval=ppl", f"task.checkpoint={out / 'export'}", cwd=tmp_path, check=False,
                  timeout=120)
    assert proc.returncode != 0
    assert "nothing to evaluate" in proc.stderr and "eval.paths.<set>=" in proc.stderr
    assert [p.name for p in (tmp_path / "outputs" / "evaluate").iterdir()] == ["tiny_qwen3_moe_frozen_router"]


def test_resuming_another_models_checkpoint_names_both(short_run, tmp_path):
    _, out = short_run
    proc = run_py("debug=fast", f"task.ckpt_path={out / 'checkpoints' / 'last.ckpt'}",
                  f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0
    assert "the checkpoint is tiny_qwen3_moe / frozen_router, the config is tiny_olmoe / sft" in proc.stderr


@pytest.mark.slow
def test_grid_with_a_failing_job_still_writes_the_sweep_summary(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_py("-m", "task.trainer.max_steps=2,1k,3", "debug=fast", "~callbacks.expert_load",
                  "~callbacks.routing_drift", f"hydra.sweep.dir={sweep}", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    rows = (sweep / "summary.md").read_text().splitlines()[2:]
    assert len(rows) == 3, rows
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
    assert [c[3] for c in cells] == ["2", "", "3"]  # the jobs after the failed one ran
    assert "task.trainer.max_steps='1k' is not a number" in cells[1][-1]


def _wandb_runs(out: Path) -> dict[str, dict]:
    """{offline run directory: {"id", "config"}} read back from the runs' transaction logs."""
    from wandb.proto import wandb_internal_pb2

    from tests.callbacks.test_wandb_offline import read_records

    runs = {}
    for run_dir in sorted((out / "wandb").glob("offline-run-*")):
        (log,) = run_dir.glob("run-*.wandb")
        run_id, config = None, {}
        for raw in read_records(log):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                items = record.run.config.update
            elif kind == "config":
                items = record.config.update
            else:
                continue
            for item in items:
                value = json.loads(item.value_json)
                config[item.key] = value["value"] if isinstance(value, dict) and set(value) == {"value"} else value
        runs[run_dir.name] = {"id": run_id, "config": config}
    return runs


@pytest.mark.slow
def test_resume_keeps_metrics_wall_time_and_the_wandb_run(tmp_path):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    common = ("debug=fast", "logger=wandb", "~callbacks.routing_drift")
    run_py(*common, "task.trainer.max_steps=3", f"hydra.run.dir={run}", cwd=tmp_path)
    first = json.loads((run / "summary.json").read_text())
    # wall time of the first segment up to its checkpoint (the work after it is redone)
    before = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]["ProgressLog"]
    assert 0 < before["wall_time_s"] <= first["wall_time_s"] + 0.05  # summary.json rounds to 0.1 s
    # one command: the run's own overrides come back, later ones win
    proc = run_py(f"task.resume={run}", "task.trainer.max_steps=6", cwd=tmp_path)
    assert f"Output directory: {run}" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 6 and summary["resumed_from_step"] == 3
    assert abs(summary["wall_time_s"] - (before["wall_time_s"] + summary["wall_time_this_run_s"])) <= 0.11
    assert _steps(run / "metrics.csv") == list(range(6))  # the first segment's rows are kept, none twice
    assert _steps(run / "metrics.csv", "val/loss") == [2, 5]
    runs = _wandb_runs(run)
    assert len(runs) == 2 and len({r["id"] for r in runs.values()}) == 1, runs.keys()
    config = list(runs.values())[-1]["config"]
    assert config["model"]["name"] == "tiny_olmoe" and config["seed"] == 42
    assert config["task"]["trainer"]["max_steps"] == 6
    assert config["dataset"]["num_examples"] == 64 and config["method"]["method"] == "sft"
    # a checkpoint continued into a new directory carries the history there
    other = tmp_path / "other"
    run_py(*common, f"task.ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "task.trainer.max_steps=8",
           f"hydra.run.dir={other}", cwd=tmp_path)
    assert _steps(other / "metrics.csv") == list(range(8))
    assert (other / "plots" / "expert_load_step000003.png").is_file()  # earlier heatmaps copied over
    assert {r["id"] for r in _wandb_runs(other).values()} == {r["id"] for r in runs.values()}


@pytest.mark.slow
def test_ctrl_c_writes_a_checkpoint_and_prints_the_resume_command(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(ROOT / "run.py"), "debug=fast", "task.trainer.max_steps=400",
           "task.checkpoint_every_n_steps=1000", "callbacks.progress.every_n_steps=1", "~callbacks.routing_drift",
           f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step 3/400" in line:
            proc.send_signal(signal.SIGINT)
            break
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=120) == 128 + signal.SIGINT, "".join(lines[-30:])
    console = "".join(lines)
    step = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 3 <= step < 400
    assert f"Resume with: python run.py task.resume={run}" in console
    assert "run interrupted, checkpoint written" in console
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["global_step"] == step and not (run / "export").exists()
    run_py(f"task.resume={run}", f"task.trainer.max_steps={step + 2}", cwd=tmp_path)
    assert json.loads((run / "summary.json").read_text())["global_step"] == step + 2
    assert _steps(run / "metrics.csv") == list(range(step + 2))
