"""Errors that say what broke (issue 21 items 17, 22, 23, 26): a truncated calibration file, a full disk, non-UTF-8
dataset bytes and a failed sweep job's root cause each name the artefact and the fix."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from hydra.errors import InstantiationException
from omegaconf import OmegaConf

from moe_lab.compress import calibrate
from moe_lab.compress.calibration import Calibration
from moe_lab.core.atomic import atomic_write_json
from moe_lab.data.sources import read_rows, stream_rows
from moe_lab.runtime.checkpoint_io import AtomicCheckpointIO
from moe_lab.sweep_summary import record_failure
from tests.conftest import build_tiny, random_batch


def test_truncated_calibration_names_the_file_the_field_and_how_to_recalibrate(tmp_path):
    path = tmp_path / "calibration.safetensors"
    calibrate(build_tiny("qwen3_moe").eval(), [random_batch(batch=2, seq=8, pad_rows=())]).save(path)
    data = path.read_bytes()
    for cut in (len(data) // 2, 20):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"compress.calibration_file=\S+calibration.safetensors: the file is "
                                             r"truncated or corrupted \(.*\)\. Recalibrate with task=calibrate"):
            Calibration.load(path, field="compress.calibration_file")
    (tmp_path / "calibration.partial.safetensors").write_bytes(data)
    with pytest.raises(ValueError, match=r"continue its partial with compress.calibration.resume_from=\S+partial"):
        Calibration.load(path)


def test_a_full_disk_names_the_path_and_the_free_space(tmp_path, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError, match=r"writing \S+summary.json failed: No space left on device \(\d+ MiB free of "
                                      r"[\d.]+ GiB on the filesystem of \S+\); free space there"):
        atomic_write_json(tmp_path / "summary.json", {"a": 1})
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []

    def torch_full(obj, f):  # what torch.save says when the disk fills (the errno is lost)
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4096 vs 0\n"
                           "PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", torch_full)
    with pytest.raises(OSError, match=r"writing \S+last.ckpt failed \(\d+ MiB free .*; torch: \[enforce fail"):
        AtomicCheckpointIO().save_checkpoint({"x": 1}, tmp_path / "checkpoints" / "last.ckpt")
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("name, content, line, column", [
    ("rows.json", b'[{"instruction": "a", "output": "b"},\n {"instruction": "caf\xe9", "output": "b"}]\n', 2, 22),
    ("rows.jsonl", b'{"instruction": "a", "output": "b"}\n{"instruction": "b\xff", "output": "c"}\n', 2, 19),
    ("text.txt", b"hello\nworld\ncaf\xe9 au lait\n", 3, 4),
])
def test_non_utf8_dataset_bytes_name_the_file_line_and_encoding(tmp_path, name, content, line, column):
    path = tmp_path / name
    path.write_bytes(content)
    expected = rf"{path}: line {line}, column {column}: bytes b'\\x[0-9a-f]{{2}}' are not UTF-8 .* iconv -f latin1"
    with pytest.raises(ValueError, match=expected):
        read_rows(str(path))
    if name.endswith(".txt"):
        with pytest.raises(ValueError, match=expected):
            list(stream_rows(str(path)))


def test_a_failed_sweep_job_keeps_its_root_cause(tmp_path):
    try:
        try:
            raise ValueError("condenser is not defined for sparsemixer routing (phimoe): use another family")
        except ValueError as root:
            raise InstantiationException("Error in call to target 'moe_lab.methods.build':\nValueError(...)") from root
    except InstantiationException as error:
        path = record_failure(tmp_path / "job", OmegaConf.create({"model": {"name": "m"}, "method": {"name": "c"}}),
                              error)
    record = json.loads(path.read_text())
    assert record["error"] == ("ValueError: condenser is not defined for sparsemixer routing (phimoe): use another "
                               "family (raised as InstantiationException: Error in call to target "
                               "'moe_lab.methods.build':)")
    assert len(record["error_chain"]) == 2
