"""A checkpoint's COMPLETED marker: where it lives, the content hash it records, and which marked checkpoints sit
beside a file (the advice of every refusal of an unverifiable checkpoint)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MARKER = "COMPLETED"


def marker_path(ckpt: str | Path) -> Path:
    """Where a checkpoint's COMPLETED marker lives: inside a directory checkpoint (DeepSpeed), beside a file."""
    ckpt = Path(ckpt)
    return ckpt / MARKER if ckpt.is_dir() else ckpt.with_name(f"{ckpt.name}.{MARKER}")


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file, read in 16 MiB chunks."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            sha.update(chunk)
    return sha.hexdigest()


def complete_beside(path: Path) -> str:
    """One sentence naming the marked checkpoints in ``path``'s directory other than ``path`` (newest first) and the
    command that resumes the newest (``task.resume`` re-applies the run's own overrides)."""
    path = Path(path)
    marked = [(p.with_name(p.name.removesuffix(f".{MARKER}")), p) for p in path.parent.glob(f"*.{MARKER}")]
    marked += [(p.parent, p) for p in path.parent.glob(f"*/{MARKER}")]
    steps = []
    for ckpt, marker in marked:
        if ckpt.resolve() == path.resolve() or not ckpt.exists():
            continue
        try:
            steps.append((int(json.loads(marker.read_text()).get("global_step", -1)), ckpt))
        except (ValueError, OSError):
            continue
    if not steps:
        return "No complete checkpoint beside it: start the run again."
    steps.sort(key=lambda s: (-s[0], s[1].name))
    names = ", ".join(f"{ckpt.name} (step {step})" for step, ckpt in steps)
    return (f"Complete checkpoints beside it: {names}; resume the newest with task.resume={steps[0][1]} (it re-applies "
            "the run's own overrides).")
