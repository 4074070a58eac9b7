"""Atomic artefact files: written to a temporary path beside the target, fsynced, then renamed over it, so a kill
never leaves a partial file under the final name. Files get the mode ``open()`` gives (the umask), not
``mkstemp``'s 0600. Directories (model exports) go through :func:`moe_lab.moe.patch.atomic_export`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


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


def atomic_write_text(path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding=encoding))


def atomic_write_json(path, obj, **dumps) -> Path:
    """``json.dumps(obj, **dumps)`` (``indent=2`` unless given) to ``path`` atomically."""
    dumps.setdefault("indent", 2)
    return atomic_write_text(path, json.dumps(obj, **dumps))
