"""Atomic artefact files: written to a temporary path beside the target, fsynced, then renamed over it, so a kill
never leaves a partial file under the final name. Files get the mode ``open()`` gives (the umask), not
``mkstemp``'s 0600. Directories (model exports) go through :func:`moe_lab.moe.patch.atomic_export`. The temporaries
a kill leaves (``.<name>.<random>.tmp`` files, ``.<name>.tmp-<random>`` export folders) are removed by
:func:`remove_stale_temporaries` when the next run takes the directory (:class:`moe_lab.tasks.run_lock.RunLock`)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

#: what torch.save says when a write fails (a full disk among the causes): it drops the OSError's errno
TORCH_WRITE_FAILED = ("file write failed", "enforce fail at inline_container")


def umask_mode(mode: int = 0o666) -> int:
    """``mode`` less the process umask: what ``open()`` gives a new file (``mkstemp`` gives 0600 whatever the
    umask, so colleagues on a shared filesystem could not read a checkpoint)."""
    try:  # Linux: read without changing it (os.umask would, for a moment, for every thread)
        status = Path("/proc/self/status").read_text()
        umask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0)
        os.umask(umask)
    return mode & ~umask


def publish_tree(path: Path) -> None:
    """Give every file under ``path`` the umask's mode (some writers, e.g. safetensors, use 0600 temporaries),
    every directory the umask's 0777, and fsync them all (before a rename publishes them)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fchmod(fd, umask_mode())
                os.fsync(fd)
            finally:
                os.close(fd)
        os.chmod(root, umask_mode(0o777))
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path, write) -> Path:
    """``write(tmp)`` writes the file at the temporary path ``tmp`` (beside ``path``), which then replaces
    ``path``; a failure removes ``tmp`` and leaves ``path`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with explain_write_failure(path):
            write(Path(tmp))
        os.chmod(tmp, umask_mode())
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def is_temporary(name: str, is_dir: bool = False) -> bool:
    """Whether ``name`` is that of a temporary of this module's writers, the checkpoint writer or an export: a
    file ``.<name>.tmp`` / ``.<name>.<random>.tmp``, a folder ``.<name>.tmp-<random>``."""
    if not name.startswith(".") or len(name) < 6:
        return False
    return ".tmp-" in name if is_dir else name.endswith(".tmp")


def remove_stale_temporaries(directory, other_runs: str | None = None) -> list[Path]:
    """Remove the temporaries (:func:`is_temporary`) under ``directory`` that a process killed between write and
    rename left, with one line naming them; returns them. Call it only while no other process writes there (the
    run lock held); subdirectories holding a file named ``other_runs`` (another run's lock) are left alone."""
    directory = Path(directory)
    stale = []
    for root, dirs, files in os.walk(directory):
        here = Path(root)
        if other_runs and here != directory and other_runs in files:
            dirs.clear()
            continue
        stale += [here / d for d in dirs if is_temporary(d, is_dir=True)]
        stale += [here / f for f in files if is_temporary(f)]
        dirs[:] = [d for d in dirs if not is_temporary(d, is_dir=True)]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if stale:
        log.info("removed %d partial files of an earlier run killed while writing in %s: %s", len(stale), directory,
                 ", ".join(str(p.relative_to(directory)) for p in sorted(stale)))
    return stale


def atomic_write_text(path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding=encoding))


def atomic_write_json(path, obj, **dumps) -> Path:
    """``json.dumps(obj, **dumps)`` (``indent=2`` unless given) to ``path`` atomically."""
    dumps.setdefault("indent", 2)
    return atomic_write_text(path, json.dumps(obj, **dumps))


def _free_space(path: Path) -> str:
    directory = next((p for p in [path, *path.parents] if p.exists()), Path("/"))
    usage = shutil.disk_usage(directory)
    return f"{usage.free / 2**20:.0f} MiB free of {usage.total / 2**30:.1f} GiB on the filesystem of {directory}"


@contextmanager
def explain_write_failure(path):
    """A full disk (``ENOSPC``, or torch's errno-less write failure) while writing ``path`` is re-raised as an
    ``OSError`` naming ``path`` and the free space, instead of the raw message."""
    path = Path(path)
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise OSError(err.errno, f"writing {path} failed: {os.strerror(err.errno)} ({_free_space(path)}); free "
                                 "space there or write elsewhere (paths.output_dir / hydra.run.dir)") from err
    except RuntimeError as err:
        if not any(text in str(err) for text in TORCH_WRITE_FAILED):
            raise
        first = str(err).strip().splitlines()[0]
        raise OSError(errno.EIO, f"writing {path} failed ({_free_space(path)}; torch: {first}): if the disk is "
                                 "full, free space there or write elsewhere (paths.output_dir / hydra.run.dir)") from err
