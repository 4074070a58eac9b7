"""Checkpoints whose COMPLETED marker is missing, stale or cannot vouch for them (issue 32).

A single-file checkpoint and its marker are two renames: a kill between them left a complete new ``last.ckpt``
beside the old marker, refused as corrupted. So the marker is written first, as ``<file>.<sha256>.PENDING``
(named by the hash of the file it vouches for), before the file's rename; a file whose hash matches a pending
marker is adopted (the pending marker becomes its COMPLETED marker, one line). A file without a usable marker
(deleted, or one of an older moe-lab without a hash) is adopted only on request, ``task.adopt_checkpoint=true``:
it is re-verified against the CRC-32 that every record of torch's zip format carries, read back whole, and given
a marker with its hash.
"""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path

import torch

from ..core.atomic import atomic_write_json
from .markers import complete_beside, marker_path, sha256_file

log = logging.getLogger(__name__)

PENDING = "PENDING"
ADOPT_FIELD = "task.adopt_checkpoint"


def pending_marker(ckpt: Path, sha256: str) -> Path:
    """The marker written before ``ckpt`` is published, named by the hash of the file it vouches for."""
    return ckpt.with_name(f"{ckpt.name}.{sha256}.{PENDING}")


def pending_markers(ckpt: Path) -> list[Path]:
    return sorted(ckpt.parent.glob(f"{ckpt.name}.*.{PENDING}"))


def write_pending(ckpt: Path, info: dict, sha256: str) -> None:
    """The marker of ``ckpt`` as it will be once published (``info`` plus the hash), before its rename."""
    atomic_write_json(pending_marker(ckpt, sha256), {**info, "sha256": {ckpt.name: sha256}}, indent=None)


def drop_pending(ckpt: Path) -> None:
    """The pending markers of ``ckpt``, once its COMPLETED marker is written (or the checkpoint removed)."""
    for path in pending_markers(ckpt):
        path.unlink(missing_ok=True)


def adopt_pending(ckpt: Path, field: str) -> dict | None:
    """The marker info of ``ckpt`` when a pending marker vouches for its content (the run was killed between the
    file's rename and its marker's): that marker becomes its COMPLETED marker, said in one line. None: none does."""
    pending = pending_markers(ckpt) if ckpt.is_file() else []
    if not pending:
        return None
    digest = sha256_file(ckpt)
    match = pending_marker(ckpt, digest)
    if match not in pending:
        return None
    info = json.loads(match.read_text())
    match.replace(marker_path(ckpt))
    drop_pending(ckpt)
    log.warning("%s=%s: its COMPLETED marker was not written (the run stopped between the two renames); the "
                "marker written before it vouches for its sha256, so it is adopted (step %s)", field, ckpt,
                info.get("global_step", "?"))
    return info


def reverify(ckpt: Path, field: str, strategy: str) -> dict:
    """``task.adopt_checkpoint=true``: re-verify ``ckpt`` (every zip record's CRC-32, then read back whole as a
    moe-lab checkpoint) and write its COMPLETED marker with its hash; returns the marker info. A ValueError names
    the file and the complete checkpoints beside it when it does not verify."""
    if ckpt.is_dir():
        raise ValueError(f"{field}={ckpt}: {ADOPT_FIELD}=true re-verifies single-file checkpoints only; a DeepSpeed "
                         f"checkpoint directory without a usable marker cannot be vouched for. {complete_beside(ckpt)}")
    try:
        with zipfile.ZipFile(ckpt) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as err:
        bad = f"the archive itself ({err})"
    if bad is not None:
        raise ValueError(f"{field}={ckpt}: {ADOPT_FIELD}=true re-verified it and it fails: {bad} does not match "
                         f"its CRC-32 (truncated or corrupted), so it is not adopted. {complete_beside(ckpt)}")
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)  # every tensor read back (no mmap)
    except Exception as err:  # noqa: BLE001 - any unreadable file: the cause goes in the message
        raise ValueError(f"{field}={ckpt}: {ADOPT_FIELD}=true re-verified it and torch cannot read it "
                         f"({type(err).__name__}: {err}), so it is not adopted. {complete_beside(ckpt)}") from None
    info = {"global_step": int(state["global_step"]), "strategy": strategy,
            "world_size": int(((state.get("moe_lab") or {}).get("run") or {}).get("world size", 1)),
            "sha256": {ckpt.name: sha256_file(ckpt)}, "adopted": True}
    del state
    atomic_write_json(marker_path(ckpt), info, indent=None)
    drop_pending(ckpt)
    log.warning("%s=%s: re-verified (every record's CRC-32, read back whole: step %d) and adopted (%s=true): "
                "%s written", field, ckpt, info["global_step"], ADOPT_FIELD, marker_path(ckpt))
    return info
