"""One run per run directory: a lock file naming the process that holds it.

``<run dir>/.moe_lab.lock`` (JSON: pid, host, SLURM job id, start time) is created exclusively (``O_EXCL``) by the
rank-zero process and removed when it ends. A second run is refused naming the first's PID and host. A lock left by
a process that is gone (kill -9) is taken over with one line when it is provably stale: the same host and that PID
no longer running, or the same SLURM job (a requeued job on another node). A lock of a live process, or of another
host, is never taken over: the message names the file to delete once that process is known to be gone. Taking
the lock removes the temporaries a killed run left in the directory (:func:`moe_lab.core.atomic.remove_stale_temporaries`);
taking it again in the process that holds it (a task running finetune in its own directory) is a no-op.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from ..core.atomic import remove_stale_temporaries

log = logging.getLogger(__name__)

LOCK_FILE = ".moe_lab.lock"
_HELD: set[Path] = set()  # lock files this process holds


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _is_rank_zero() -> bool:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


class RunLock:
    """``with RunLock(run_dir):`` holds ``run_dir`` for this process (a no-op on ranks other than zero, which the
    rank-zero process launched into the directory it holds)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def _mine(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def _stale(self, other: dict) -> str | None:
        """Why ``other``'s lock is provably stale (None: it may be live)."""
        if other.get("host") == socket.gethostname() and isinstance(other.get("pid"), int) \
                and not _alive(other["pid"]):
            return f"PID {other['pid']} on this host is no longer running"
        job = os.environ.get("SLURM_JOB_ID")
        if job and other.get("slurm_job") == job and other.get("pid") != os.getpid():
            return f"it was this SLURM job's ({job}) before its requeue"
        return None

    def acquire(self) -> RunLock:
        if not _is_rank_zero() or self.path.resolve() in _HELD:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a lock removed or taken over between our attempts: try again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    other = json.loads(self.path.read_text() or "{}")
                except (OSError, ValueError):
                    other = {}
                why = self._stale(other) if other else None
                if why is None:
                    who = f"PID {other.get('pid', '?')} on host {other.get('host', '?')}"
                    raise RuntimeError(
                        f"{self.path.parent} is in use by another run ({who}, started {other.get('started', '?')}): "
                        "two runs in one directory would mix their checkpoints and metrics. Wait for it to end or "
                        f"give another hydra.run.dir; if that process is gone, delete {self.path}") from None
                log.warning("run lock %s: taking it over (%s)", self.path, why)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self._mine()) + "\n")
            self.held = True
            _HELD.add(self.path.resolve())
            remove_stale_temporaries(self.path.parent, other_runs=LOCK_FILE)  # no other process writes there now
            return self
        raise RuntimeError(f"{self.path}: could not take the run lock (it keeps changing hands)")

    def release(self) -> None:
        if self.held:
            _HELD.discard(self.path.resolve())
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
