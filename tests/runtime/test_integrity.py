"""Checkpoint integrity (issue 21): a content hash in the COMPLETED marker verified before a resume, corrupted and
truncated files refused naming the complete checkpoints beside them, hints that name task.resume."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat

import lightning as L
import pytest
import torch

from moe_lab.runtime.checkpoint_io import (
    MARKER,
    AtomicCheckpointIO,
    check_resumable,
    checkpoint_callback,
    marker_path,
    read_checkpoint,
)
from tests.runtime.test_checkpoints import _Linear


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
    """A marker of an older moe-lab (no hash) over a truncated file: refused (it cannot vouch for the file), and
    re-verified on request it fails; read_checkpoint says truncated or corrupted (not 'use last.ckpt', which is what
    was given) and names the complete checkpoints beside it."""
    _fit(tmp_path)
    ckpt = tmp_path / "last.ckpt"
    info = json.loads(marker_path(ckpt).read_text())
    info.pop("sha256")
    marker_path(ckpt).write_text(json.dumps(info))
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"records no sha256 .*task.adopt_checkpoint=true"):
        check_resumable(ckpt, "task.resume", "single")
    with pytest.raises(ValueError, match=r"re-verified it and it fails.*truncated or corrupted.*step-4.ckpt"):
        check_resumable(ckpt, "task.resume", "single", adopt=True)
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


# ---- a non-finite loss or weights stop the run, the last good checkpoint kept (issue 21.7) ---------------------
def _sft_fit(tmp_path, lr, max_steps=4, callbacks=()):
    from moe_lab.methods.base import MoELightningModule
    from tests.conftest import build_tiny, random_batch

    batch = random_batch(batch=4)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(4)]
    module = MoELightningModule(build_tiny("qwen3_moe"), optim={"lr": lr})
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()],
                        callbacks=[*callbacks, checkpoint_callback(tmp_path, every_n_train_steps=1, keep_last=3)])
    with pytest.raises(FloatingPointError) as err:
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(rows, batch_size=1))
    return module, batch, str(err.value)


def test_nan_loss_stops_before_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    """lr=1e20 (the issue's case): step 1's update puts weights at ~1e20, step 2's loss is NaN. The run stops before
    step 2's update, naming the step and step 1's loss (oracle: vanilla HF's loss of the first batch)."""
    from tests.conftest import build_tiny

    module, batch, msg = _sft_fit(tmp_path, lr=1e20)
    first = {k: v[:1] for k, v in batch.items()}
    with torch.no_grad():
        expected = build_tiny("qwen3_moe")(**first).loss.item()
    assert "method=sft: non-finite training loss nan at optimizer step 2" in msg
    assert f"last finite loss {expected:.6g} (step 1)" in msg and "task.optim.lr" in msg
    assert module.trainer.global_step == 1 and all(torch.isfinite(p).all() for p in module.parameters())
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["last.ckpt", "step-1.ckpt"]
    ckpt = read_checkpoint(tmp_path / "last.ckpt")
    assert ckpt["global_step"] == 1 and all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())


def test_non_finite_weights_are_never_written_to_a_checkpoint(tmp_path):
    """An update that overflows at step 2 (finite loss, an infinite weight; set by a callback that runs before the
    checkpoint callback, as Lightning orders them): the checkpoint of step 2 is refused naming the step and the
    parameter, step 1's stays."""
    class Overflow(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                with torch.no_grad():
                    pl_module.model.lm_head.weight[0, 0] = float("inf")

    _, _, msg = _sft_fit(tmp_path, lr=1e-3, callbacks=[Overflow()])
    assert "weights after optimizer step 2 are not finite (model.lm_head.weight)" in msg and "not written" in msg
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["last.ckpt", "step-1.ckpt"]
    assert read_checkpoint(tmp_path / "last.ckpt")["global_step"] == 1


# ---- file modes and stale temporaries (issue 21.21, 21.20) ------------------------------------------------------
def test_checkpoints_and_markers_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        _fit(tmp_path, keep_last=0, max_steps=1)
    finally:
        os.umask(old)
    for name in ("last.ckpt", f"last.ckpt.{MARKER}"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name


def test_stale_temporaries_of_a_killed_write_are_removed_at_the_next_start(tmp_path, caplog):
    """Checkpoint and marker temporaries, an export's temporary folder, at any depth; not files that merely end in
    .tmp, nor the folder of another run (its lock file inside)."""
    from moe_lab.core.atomic import remove_stale_temporaries

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".last.ckpt.k2j3.tmp").write_bytes(b"half")
    (tmp_path / "checkpoints" / f".last.ckpt.{MARKER}.tmp").write_text("{")
    (tmp_path / ".export.tmp-a1b2").mkdir()
    (tmp_path / ".export.tmp-a1b2" / "config.json").write_text("{}")
    (tmp_path / "keep.tmp").write_text("not ours")
    (tmp_path / ".export.old").mkdir()  # the previous export, kept while the new one is renamed in
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / ".lock").write_text("{}")
    (tmp_path / "other" / ".summary.json.x.tmp").write_text("{")
    with caplog.at_level(logging.INFO, logger="moe_lab.core.atomic"):
        remove_stale_temporaries(tmp_path, other_runs=".lock")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        ".export.old", "checkpoints", "keep.tmp", "other", "other/.lock", "other/.summary.json.x.tmp"]
    [line] = [r.getMessage() for r in caplog.records]
    assert "3 partial files" in line and str(tmp_path) in line
    assert f".export.tmp-a1b2, checkpoints/.last.ckpt.{MARKER}.tmp, checkpoints/.last.ckpt.k2j3.tmp" in line


def test_deepspeed_directory_is_verified_file_by_file(tmp_path):
    """A DeepSpeed checkpoint directory: one digest per file (rank files included); one changed file is named."""
    from moe_lab.runtime.checkpoint_io import content_digests

    ckpt = tmp_path / "step-2.ckpt"
    (ckpt / "global_step2").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step2")
    for rank in range(2):
        (ckpt / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(bytes([rank]) * 100)
    digests = content_digests(ckpt)
    assert digests == {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
                       for p in ckpt.rglob("*") if p.is_file()}
    (ckpt / MARKER).write_text(json.dumps({"global_step": 2, "strategy": "deepspeed_zero2", "world_size": 2,
                                           "sha256": digests}))
    check_resumable(ckpt, "task.resume", "deepspeed_zero2")
    _flip_bytes(ckpt / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(ValueError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt does not match the sha256"):
        check_resumable(ckpt, "task.resume", "deepspeed_zero2")
