"""`python run.py -m hydra/launcher=slurm` against a REAL single-node SLURM cluster (scripts/slurm_local.sh).

Skipped, with the reason, when no cluster can be started here (SLURM not installed, not root, daemons fail).
CI installs and starts it first (.ci/run). On failure every test prints squeue, the slurm daemons' logs and the
jobs' submitit logs.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "slurm_local.sh"
TINY = ("debug=fast", "~callbacks.expert_load", "~callbacks.routing_drift", "callbacks.progress.every_n_steps=1")


def sh(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def cluster():
    """The local cluster, started if its packages are installed (never installs them: CI does that)."""
    if shutil.which("sinfo") is None or shutil.which("slurmctld") is None:
        pytest.skip("SLURM is not installed here (CI installs it: sudo scripts/slurm_local.sh start)")
    if os.geteuid() != 0 and sh(["sinfo", "-h"]).returncode != 0:
        pytest.skip("no SLURM cluster running and starting one needs root (sudo scripts/slurm_local.sh start)")
    if os.geteuid() == 0:
        proc = sh(["bash", str(SCRIPT), "start"], timeout=180, env={**os.environ, "SLURM_LOCAL_NO_INSTALL": "1"})
        if proc.returncode != 0:
            pytest.skip(f"scripts/slurm_local.sh start failed: {proc.stderr.strip()[-500:]}")
    partition = sh(["sinfo", "-h", "-o", "%P"]).stdout.split()
    if not partition:
        pytest.skip("SLURM has no partition up")
    return partition[0].rstrip("*")


def _env():
    return {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def diagnostics(sweep: Path | None = None) -> str:
    """squeue, the daemons' logs and the jobs' submitit logs, for a failure message."""
    parts = []
    for cmd in (["squeue", "-a"], ["sinfo"], ["tail", "-n", "25", "/var/log/slurm/slurmctld.log"],
                ["tail", "-n", "15", "/var/log/slurm/slurmd.log"]):
        out = sh(cmd)
        parts.append(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}")
    if sweep is not None:
        for log in sorted(sweep.glob(".submitit/*/*_log.*")):
            parts.append(f"== {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))
    return "\n".join(parts)


def multirun(*overrides, sweep: Path, cwd: Path, timeout=420) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}", *overrides]
    try:
        return sh(cmd, cwd=cwd, env=_env(), timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"run.py -m did not finish in {timeout}s\n{diagnostics(sweep)}") from err


def _steps(path: Path, column="train/loss") -> list[int]:
    with open(path) as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get(column)]


def _table(sweep: Path) -> list[list[str]]:
    rows = (sweep / "summary.md").read_text().splitlines()[2:]
    return [[c.strip() for c in row.split("|")[1:-1]] for row in rows]


def _jobs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if p.is_dir() and (p / "config.yaml").exists()),
                  key=lambda p: int(p.name.split("_")[0]))


@pytest.mark.slurm
@pytest.mark.slow
def test_grid_runs_as_slurm_jobs_with_outputs_and_summary(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    proc = multirun(*TINY, "method=sft,frozen_router", "task.trainer.max_steps=2,3", sweep=sweep, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}\n{diagnostics(sweep)}"
    jobs = _jobs(sweep)
    expected = [("sft", 2), ("sft", 3), ("frozen_router", 2), ("frozen_router", 3)]
    assert [(OmegaConf.load(j / "config.yaml").method.name, OmegaConf.load(j / "config.yaml").task.trainer.max_steps)
            for j in jobs] == expected, diagnostics(sweep)
    for job, (_, steps) in zip(jobs, expected):
        summary = json.loads((job / "summary.json").read_text())
        assert summary["global_step"] == steps and not summary["interrupted"]
        assert _steps(job / "metrics.csv") == list(range(steps))
        assert (job / "export" / "model.safetensors").is_file() and (job / "checkpoints" / "last.ckpt").is_file()
    # every job ran as a SLURM job, submitted with the launcher's settings interpolated from the trainer's
    scripts = sorted(sweep.glob(".submitit/*/*_submission.sh"))
    assert scripts, diagnostics(sweep)
    sbatch = scripts[0].read_text()
    assert "#SBATCH --ntasks-per-node=1" in sbatch and "#SBATCH --nodes=1" in sbatch
    assert "#SBATCH --signal=USR1@120" in sbatch and "--gpus-per-node" not in sbatch  # cpu hardware: no GPUs
    logs = sorted(sweep.glob(".submitit/*/*_0_log.out"))
    assert len(logs) == 4 and all("Starting with JobEnvironment(job_id=" in p.read_text() for p in logs)
    table = _table(sweep)
    assert [(c[2], c[3]) for c in table] == [(m, str(s)) for m, s in expected]
    assert all(c[4] and not c[-1] for c in table)  # a train loss and no error in every row


@pytest.mark.slurm
@pytest.mark.slow
def test_failed_job_is_reported_and_the_others_run(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    proc = multirun(*TINY, "task.trainer.max_steps=1k,2", sweep=sweep, cwd=tmp_path)
    assert proc.returncode != 0
    assert (sweep / "summary.md").is_file(), f"{proc.stderr[-3000:]}\n{diagnostics(sweep)}"
    table = _table(sweep)
    assert [c[3] for c in table] == ["", "2"], table  # job 1 ran although job 0 failed
    assert "task.trainer.max_steps='1k' is not a number" in table[0][-1]
    assert "is not a number" in proc.stderr  # and the multirun itself fails with that error


@pytest.mark.slurm
@pytest.mark.slow
def test_unknown_partition_fails_with_the_sbatch_error(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    proc = multirun(*TINY, "++local.slurm.partition=no_such_partition", "hardware=ddp_cpu", "seed=1,2", sweep=sweep,
                    cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "sbatch: error: invalid partition specified: no_such_partition" in proc.stderr, proc.stderr[-3000:]
    assert not list(sweep.glob("*/config.yaml"))  # nothing ran
    (script,) = sweep.glob(".submitit/.submission_file_*.sh")  # what was submitted: 2 devices -> 2 tasks per node
    assert "#SBATCH --ntasks-per-node=2" in script.read_text()
    assert "#SBATCH --partition=no_such_partition" in script.read_text()


def _wait_for(what: str, predicate, timeout: float, sweep: Path, poll=0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{diagnostics(sweep)}")


def _squeue_state(job: str) -> str:
    return sh(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()


def _wandb_ids(run: Path) -> list[str]:
    """The run id of every offline W&B run directory (``offline-run-<time>-<id>``), in order."""
    return [p.name.rsplit("-", 1)[1] for p in sorted((run / "wandb").glob("offline-run-*"))]


@pytest.mark.slurm
@pytest.mark.slow
def test_usr1_checkpoints_and_the_requeued_job_continues_the_same_run(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    # long enough that the signal sent after step 2 lands before the end on an idle machine (~10 steps/s)
    steps = 40
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}", *TINY,
           "logger=wandb", f"task.trainer.max_steps={steps}", "task.trainer.limit_val_batches=0",
           "task.checkpoint_every_n_steps=1000"]
    master = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        log = _wait_for("the job's log", lambda: next(iter(sweep.glob(".submitit/*/*_0_log.out")), None), 120, sweep)
        job = log.parent.name
        _wait_for("step 2", lambda: "step 2/" in log.read_text(), 180, sweep)
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        # a requeued job waits for its begin time (~2 min by SLURM's default): the admin's "start now"
        _wait_for("the requeue", lambda: _squeue_state(job) == "PENDING", 60, sweep)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        out, _ = master.communicate(timeout=240)
    except BaseException:
        master.kill()
        raise
    assert master.returncode == 0, f"{out[-3000:]}\n{diagnostics(sweep)}"
    text = "\n".join(p.read_text() for p in sorted(log.parent.glob("*_log.*")))
    assert "SIGUSR1 received" in text and f"Requeued job {job}" in text, diagnostics(sweep)
    assert "SLURM auto-requeueing enabled" not in text  # one requeue owner: submitit, not Lightning
    (run,) = _jobs(sweep)  # the same run directory
    summary = json.loads((run / "summary.json").read_text())
    resumed = summary["resumed_from_step"]
    assert summary["global_step"] == steps and 2 <= resumed < steps, summary
    assert f"continuing {run / 'checkpoints' / 'last.ckpt'}" in text
    # the loss curve continues: every step once, none missing, none repeated
    assert _steps(run / "metrics.csv") == list(range(steps)), diagnostics(sweep)
    # the same W&B run continued (offline): both segments carry the id stored beside the checkpoint
    run_id = (run / "checkpoints" / "wandb_run_id").read_text().strip()
    assert _wandb_ids(run) == [run_id, run_id]
    table = _table(sweep)
    assert len(table) == 1 and table[0][3] == str(steps) and not table[0][-1]


def test_signal_handover_only_inside_a_submitit_slurm_job(monkeypatch):
    """Outside a submitit SLURM job nothing is handed over (a Ctrl-C'd local run must not call scontrol)."""
    from moe_lab.runtime import slurm

    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    before = signal.getsignal(signal.SIGUSR1)
    requeue = slurm.SubmititRequeue()
    assert requeue.handler is None and signal.getsignal(signal.SIGUSR1) is before
    requeue(signal.SIGUSR1)  # no-op


@pytest.mark.parametrize("devices, accelerator, tasks, gpus", [
    (1, "cpu", 1, None), (2, "cpu", 2, None), (4, "gpu", 4, 4), ("2", "cuda", 2, 2), ([0, 1, 3], "gpu", 3, 3),
])
def test_launcher_tasks_and_gpus_follow_the_trainer(devices, accelerator, tasks, gpus):
    from moe_lab.runtime import slurm

    cfg = OmegaConf.create({"hardware": {"trainer": {"accelerator": accelerator, "devices": devices}},
                            "t": "${moe_lab.slurm_tasks:${hardware.trainer.devices}}",
                            "g": "${moe_lab.slurm_gpus:${hardware.trainer.accelerator},${hardware.trainer.devices}}"})
    assert slurm.OmegaConf.has_resolver("moe_lab.slurm_tasks")
    assert (cfg.t, cfg.g) == (tasks, gpus)


def test_devices_auto_is_refused_naming_the_field():
    from moe_lab.runtime.slurm import _tasks

    with pytest.raises(ValueError, match=r"hardware.trainer.devices='auto'.*hardware.trainer.devices=<n>"):
        _tasks("auto")


def test_only_a_requeued_slurm_job_with_a_checkpoint_resumes(monkeypatch, tmp_path):
    from moe_lab.runtime.slurm import resume_requeued

    def cfg(**task):
        return OmegaConf.create({"paths": {"output_dir": str(tmp_path)}, "task": {"resume": None, "ckpt_path": None,
                                                                                 **task}})

    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"x")
    c = cfg()
    assert not resume_requeued(c) and c.task.resume is None  # first run of the job
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    c = cfg()
    assert resume_requeued(c) and c.task.resume == str(tmp_path)
    c = cfg(ckpt_path="/elsewhere.ckpt")
    assert not resume_requeued(c) and c.task.resume is None  # an explicit choice wins
    (tmp_path / "checkpoints" / "last.ckpt").unlink()
    c = cfg()
    assert not resume_requeued(c) and c.task.resume is None  # requeued before its first checkpoint: start over


def test_trainer_gets_slurm_environment_without_lightning_requeue_inside_a_job(monkeypatch):
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from moe_lab.runtime.slurm import cluster_plugins

    for var in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(var, raising=False)
    assert cluster_plugins() == []  # not in a job: Lightning's own choice
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "run")
    (env,) = cluster_plugins()
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue is False


def test_ep_grid_config_places_each_ep_group_on_one_node():
    """hardware=gpu_ep on 2 nodes of 8 GPUs under hydra/launcher=slurm: 8 tasks per node, 16 ranks, EP groups of 8
    consecutive ranks, so each group (every expert once) sits on one node and its all-to-all never leaves it; the
    data-parallel groups (the same experts) pair rank r with rank r + 8 across the nodes."""
    from hydra import compose, initialize_config_dir

    from moe_lab.runtime import slurm
    from moe_lab.runtime.expert_parallel import ep_groups

    slurm.register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True,
                      overrides=["hydra/launcher=slurm", "hardware=gpu_ep", "hardware.trainer.num_nodes=2"])
    launcher = cfg.hydra.launcher
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)
    world = launcher.nodes * launcher.tasks_per_node
    groups = ep_groups(world, cfg.hardware.ep_size)
    assert groups == [list(range(8)), list(range(8, 16))]
    assert all(len({rank // launcher.tasks_per_node for rank in group}) == 1 for group in groups)
    with pytest.raises(ValueError, match=r"hardware.ep_size=3 must divide the world size 16"):
        ep_groups(world, 3)


@pytest.mark.slurm
@pytest.mark.slow
def test_expert_parallel_job_runs_as_two_slurm_tasks(cluster, tmp_path):
    """hardware=ddp_cpu_ep as a SLURM job: 2 tasks, one EP group of 2 ranks (each holding 4 of 8 experts), a
    whole export."""
    sweep = tmp_path / "sweep"
    proc = multirun(*TINY, "model=tiny_qwen3_moe", "hardware=ddp_cpu_ep", sweep=sweep, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}\n{diagnostics(sweep)}"
    (job,) = _jobs(sweep)
    assert json.loads((job / "summary.json").read_text())["global_step"] == 6
    (script,) = sweep.glob(".submitit/*/*_submission.sh")
    assert "#SBATCH --ntasks-per-node=2" in script.read_text()
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.*"))
    assert "4 of 8 experts on EP rank 0 of 2" in logs and "4 of 8 experts on EP rank 1 of 2" in logs, diagnostics(sweep)
    import safetensors.torch

    export = safetensors.torch.load_file(job / "export" / "model.safetensors")
    assert all(t.shape[0] == 8 for k, t in export.items() if k.endswith("experts.gate_up_proj"))
