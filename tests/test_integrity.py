"""Checkpoint integrity (issue 21): a content hash in the COMPLETED marker verified before a resume, corrupted and
truncated files refused naming the complete checkpoints beside them, hints that name task.resume."""

from __future__ import annotations

import hashlib
import json

import lightning as L
import pytest
import torch

from moe_lab.tasks.checkpoint_io import (
    AtomicCheckpointIO,
    check_resumable,
    checkpoint_callback,
    marker_path,
    read_checkpoint,
)
from tests.test_checkpoints import _Linear


def _fit(tmp_path, keep_last=2, max_steps=4):
    callback = checkpoint_callback(tmp_path, every_n_train_steps=1, keep_last=keep_last)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, callbacks=[callback],
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        plugins=[AtomicCheckpointIO()])
    trainer.fit(_Linear(), torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=2))


def _flip_bytes(path, offset_fraction=0.5, count=64):
    data = bytearray(path.read_bytes())
    at = int(len(data) * offset_fraction)
    data[at:at + count] = bytes((b ^ 0xFF) for b in data[at:at + count])
    path.write_bytes(bytes(data))


def test_marker_records_the_sha256_of_the_file_written(tmp_path):
    """Oracle: hashlib over the bytes on disk, computed here independently of the streaming hash."""
    _fit(tmp_path)
    for name in ("last.ckpt", "step-3.ckpt", "step-4.ckpt"):
        info = json.loads(marker_path(tmp_path / name).read_text())
        assert info["sha256"] == {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}
        check_resumable(tmp_path / name, "task.resume", "single")


def test_corrupted_checkpoint_is_refused_naming_it_and_the_complete_ones(tmp_path):
    """64 flipped bytes inside last.ckpt, its marker present (the issue's case: torch.load does not check CRCs)."""
    _fit(tmp_path)
    ckpt = tmp_path / "last.ckpt"
    _flip_bytes(ckpt)
    with pytest.raises(ValueError) as err:
        check_resumable(ckpt, "task.resume", "single")
    msg = str(err.value)
    assert f"task.resume={ckpt}" in msg and "sha256" in msg and "corrupted" in msg
    assert f"task.resume={tmp_path / 'step-4.ckpt'}" in msg and "step-3.ckpt" in msg
    check_resumable(tmp_path / "step-4.ckpt", "task.resume", "single")  # the neighbours still verify


def test_truncated_checkpoint_without_a_hash_says_truncated_and_names_the_complete_ones(tmp_path):
    """A marker of an older moe-lab (no hash) over a truncated file: read_checkpoint says truncated or corrupted
    (not 'use last.ckpt', which is what was given) and names the complete checkpoints beside it."""
    _fit(tmp_path)
    ckpt = tmp_path / "last.ckpt"
    info = json.loads(marker_path(ckpt).read_text())
    info.pop("sha256")
    marker_path(ckpt).write_text(json.dumps(info))
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    check_resumable(ckpt, "task.resume", "single")  # nothing to verify against
    with pytest.raises(ValueError) as err:
        read_checkpoint(ckpt, "task.resume")
    msg = str(err.value)
    assert "truncated or corrupted" in msg and "use <run dir>/checkpoints/last.ckpt" not in msg
    assert f"task.resume={tmp_path / 'step-4.ckpt'}" in msg


def test_half_written_hint_names_task_resume_with_the_full_path(tmp_path):
    """Issue 21.2: task.ckpt_path=<file> would continue with the default config; the hint names task.resume."""
    _fit(tmp_path)
    marker_path(tmp_path / "last.ckpt").unlink()
    with pytest.raises(ValueError) as err:
        check_resumable(tmp_path / "last.ckpt", "task.resume", "single")
    msg = str(err.value)
    assert f"task.resume={tmp_path / 'step-4.ckpt'}" in msg and "task.ckpt_path=" not in msg
