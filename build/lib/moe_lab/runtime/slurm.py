"""SLURM: one requeue owner (submitit), the Lightning cluster environment, and continuing a requeued job.

``python run.py -m hydra/launcher=slurm ...`` runs every job of a grid as a SLURM job through
hydra-submitit-launcher (conf/hydra/launcher/slurm.yaml). Who requeues a job that is about to time out or is
preempted: **submitit**, never Lightning. Lightning's own ``SLURMEnvironment(auto_requeue=True)`` (its default
inside SLURM) saves an ``hpc_ckpt_<n>.ckpt`` from inside the signal handler, in the middle of a step, calls
``scontrol requeue`` and keeps running until SLURM kills it; it knows nothing of the Hydra job it runs in. So:

1. the trainer gets ``SLURMEnvironment(auto_requeue=False)`` (:func:`cluster_plugins`): Lightning reads ranks
   and world size from SLURM but installs no requeue handler;
2. the scheduler's warning is SIGUSR1 (sbatch ``--signal=USR1@<signal_delay_s>``, or ``scancel --signal=USR1``):
   moe-lab's ``CheckpointOnSignal`` finishes the current optimizer step and writes ``checkpoints/last.ckpt``
   (metrics flushed, loggers closed); then :class:`SubmititRequeue` hands the signal to submitit's own handler,
   which pickles the same Hydra job again, runs ``scontrol requeue`` and exits (it also counts timeouts:
   ``max_num_timeout``). Before training starts, SIGUSR1 goes to submitit at once (nothing to save yet);
   submitit's native SIGUSR2 still requeues at once, from the last periodic checkpoint;
3. the requeued job (``SLURM_RESTART_COUNT`` > 0) has the same run directory (the sweep's ``now`` is pickled
   with the job), so :func:`resume_requeued` continues its ``checkpoints/last.ckpt`` exactly as
   ``task.resume=<run dir>`` would: same directory, metrics.csv continued, the same W&B run id.

``scontrol requeue <job>`` and SLURM's own preemption (SIGTERM) are requeued by SLURM itself; the checkpoint
on SIGTERM and step 3 make them continue the same way.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)

REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def in_slurm_job() -> bool:
    """True inside a SLURM job (batch script or job step)."""
    return "SLURM_JOB_ID" in os.environ


def cluster_plugins() -> list:
    """Trainer plugins for the cluster: inside a SLURM job step, ``SLURMEnvironment(auto_requeue=False)`` (ranks
    from SLURM, requeueing left to submitit); elsewhere none (Lightning's own choice)."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    if not in_slurm_job():  # srun installed on a login node or workstation: a local run is not a mistake
        warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
        return []
    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def resume_requeued(cfg: DictConfig) -> bool:
    """A requeued SLURM job (``SLURM_RESTART_COUNT`` > 0) with ``<run dir>/checkpoints/last.ckpt`` and no explicit
    ``task.resume``/``task.ckpt_path`` continues that checkpoint (sets ``task.resume=<run dir>``); returns whether
    it did."""
    if int(os.environ.get("SLURM_RESTART_COUNT") or 0) < 1:
        return False
    if OmegaConf.select(cfg, "task.resume") or OmegaConf.select(cfg, "task.ckpt_path"):
        return False
    out = Path(cfg.paths.output_dir)
    if not (out / "checkpoints" / "last.ckpt").is_file():
        log.info("requeued SLURM job (restart %s): no checkpoint in %s yet, starting over",
                 os.environ["SLURM_RESTART_COUNT"], out)
        return False
    with open_dict(cfg):
        cfg.task.resume = str(out)
    log.info("requeued SLURM job %s (restart %s): continuing %s", os.environ.get("SLURM_JOB_ID"),
             os.environ["SLURM_RESTART_COUNT"], out / "checkpoints" / "last.ckpt")
    return True


def _submitit_handler():
    """submitit's checkpoint-and-requeue signal handler when this process is a submitit SLURM job, else None."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    from submitit.core.job_environment import JobEnvironment

    handler = signal.getsignal(JobEnvironment._usr_sig())
    return handler if getattr(handler, "__name__", "") == "checkpoint_and_try_requeue" else None


class SubmititRequeue:
    """Create before training (it finds submitit's handler while it is still installed, and routes an early
    SIGUSR1 to it); call with the signal that interrupted training once the checkpoint is written: for
    SIGUSR1/SIGUSR2 in a submitit SLURM job, submitit requeues the job and exits the process."""

    def __init__(self):
        self.handler = _submitit_handler()
        if self.handler is not None and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGUSR1, self.handler)

    def __call__(self, signum: int | None) -> None:
        if signum is None or not in_slurm_job():
            return
        # before SLURM's SIGTERM (requeue, preemption) takes the step's processes down, W&B's service among them;
        # the requeued job continues the same W&B run id
        _finish_wandb()
        if self.handler is None or signum not in REQUEUE_SIGNALS:
            return
        log.info("%s: checkpoint written, handing over to submitit to requeue this job",
                 signal.Signals(signum).name)
        self.handler(signum, None)


def _finish_wandb() -> None:
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        try:
            wandb.finish()
        except Exception as err:  # noqa: BLE001 - the checkpoint is written; a lost W&B tail must not fail the job
            log.warning("W&B run not finished cleanly before the requeue (%s: %s)", type(err).__name__, err)


def _tasks(devices) -> int:
    """SLURM tasks per node for the trainer's ``devices`` (one process per device)."""
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        return len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    raise ValueError(f"hardware.trainer.devices={devices!r}: a SLURM job needs a number of devices per node "
                     "(its tasks_per_node and gpus_per_node follow it); set hardware.trainer.devices=<n>")


def _gpus(accelerator, devices):
    """GPUs per node: the trainer's devices on a GPU accelerator, none otherwise."""
    return _tasks(devices) if str(accelerator) in ("gpu", "cuda") else None


def register_resolvers() -> None:
    """``${moe_lab.slurm_tasks:<devices>}`` and ``${moe_lab.slurm_gpus:<accelerator>,<devices>}`` for the launcher
    configs."""
    for name, fn in (("moe_lab.slurm_tasks", _tasks), ("moe_lab.slurm_gpus", _gpus)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()

try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency
    _HydraCallback = object


class SlurmLauncherCallback(_HydraCallback):
    """Hydra callback of the submitit launcher configs: importing it registers the resolvers above before Hydra
    instantiates the launcher."""
