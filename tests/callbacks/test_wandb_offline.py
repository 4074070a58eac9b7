"""ExpertLoadCallback + GradNormCallback with an offline WandbLogger, read back from the run's files.

wandb 0.31 offline writes no ``files/wandb-summary.json`` (nor config.yaml): the whole run is in
``offline-run-*/run-<id>.wandb``, a LevelDB-log style file of ``wandb_internal_pb2.Record`` protos (the
Python ``wandb.sdk.internal.datastore`` reader is gone since the Go core). Logged images are copied to
``files/media/images/``. The small reader below follows that format.
"""

from __future__ import annotations

import json
import struct
import time

import lightning as L
import pytest

wandb = pytest.importorskip("wandb")
from google.protobuf.message import DecodeError
from lightning.pytorch.loggers import WandbLogger
from wandb.proto import wandb_internal_pb2

from moe_lab.callbacks import ExpertLoadCallback, GradNormCallback

from .conftest import TinyModule, loader, random_batches

BLOCK = 32768
# File header: ":W&B", magic 0xBEE1 (uint16), version (uint8). Record header: crc32 (uint32),
# length (uint16), type (uint8). Both 7 bytes.
HEADER = 7


def read_records(path):
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk, pos = data[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        if len(chunk) < length:  # still being written
            return
        if kind == 1:  # full
            yield chunk
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            yield pending + chunk
            pending = b""
        else:
            break


def history_rows(run_dir, timeout=30.0):
    """History rows of the run, once its transaction log is complete (ends with an ``exit`` record).

    ``wandb.finish()`` in offline mode can return before wandb-core has flushed the file, so poll.
    """
    (log,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        rows, done = [], False
        try:
            for raw in read_records(log):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(raw)
                kind = record.WhichOneof("record_type")
                done |= kind == "exit"
                if kind == "history":
                    rows.append(
                        {
                            item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item
                        }
                    )
        except DecodeError:  # a partially written record
            done = False
        if done:
            return rows
        assert time.monotonic() < deadline, f"{log} has no exit record after {timeout} s"
        time.sleep(0.2)


def test_wandb_offline_run_contains_load_and_grad_norm(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="moe-lab-test")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=logger,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ExpertLoadCallback(log_every_n_steps=2, heatmap_every_n_steps=3), GradNormCallback()],
    )
    try:
        trainer.fit(TinyModule(), loader(random_batches(4)))
    finally:
        wandb.finish()

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = history_rows(run_dir)
    keys = set().union(*rows)
    assert "load/layer0/gini" in keys and "load/gini_mean" in keys
    assert {"grad_norm/total", "grad_norm/router"} <= keys
    grad_steps = sorted(r["trainer/global_step"] for r in rows if "grad_norm/total" in r)
    assert grad_steps == [0, 1, 2, 3]
    load_rows = [r for r in rows if "load/layer0/gini" in r]
    assert [r["trainer/global_step"] for r in load_rows] == [1, 3]

    # one histogram bin per expert, heights = load fractions
    hist = load_rows[0]
    assert hist["load/layer0/histogram/_type"] == "histogram"
    assert hist["load/layer0/histogram/bins"] == list(range(9))
    assert sum(hist["load/layer0/histogram/values"]) == pytest.approx(1.0)

    # heatmaps at step 3 and at train end (step 4), as PNGs locally and as W&B images
    images = [r for r in rows if r.get("load/heatmap/_type") == "images/separated"]
    assert len(images) == 2
    assert len(list((run_dir / "files" / "media" / "images").rglob("heatmap_*.png"))) == 2  # (+ 2 Lorenz)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "expert_load_latest.png",
        "expert_load_step000003.png",
        "expert_load_step000004.png",
    ]
