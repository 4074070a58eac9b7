"""Artefacts are written atomically with the umask's mode (issue 21 items 6, 21): a failure while writing an export,
a summary or a teacher record leaves the previous artefact whole; an export without its manifest is refused by
task=evaluate and by model loading, naming what is missing."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.compress.dense import MANIFEST_FILE, export_compressed
from moe_lab.core.atomic import atomic_write_json
from moe_lab.data.tokenizer import load_tokenizer
from moe_lab.distill import teacher_logits
from moe_lab.models import load_model
from moe_lab.runs.evaluate import load_for_eval
from tests.conftest import build_tiny
from tests.eval.test_evaluate_task import eval_cfg


class Boom(RuntimeError):
    pass


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def _student():
    model = build_tiny("qwen3_moe")
    model.moe_lab_manifest = {"method": "test"}
    return model


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_export_killed_before_its_manifest_leaves_no_partial_export(tmp_path, monkeypatch):
    """The old writer left config.json + weights in export/ when the manifest write failed."""
    export = tmp_path / "export"
    student, tokenizer = _student(), load_tokenizer("byte")
    export_compressed(student, export, tokenizer)
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    student.moe_lab_manifest = {"method": "second"}
    real_write_text = type(export).write_text

    def failing(self, *args, **kwargs):
        if self.name == MANIFEST_FILE:
            raise Boom("killed")
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(type(export), "write_text", failing)
    with pytest.raises(Boom):
        export_compressed(student, tmp_path / "fresh", tokenizer)
    with pytest.raises(Boom):
        export_compressed(student, export, tokenizer)
    monkeypatch.undo()
    assert not (tmp_path / "fresh").exists()
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before  # the earlier export, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary folder left


def test_export_follows_the_umask(tmp_path, umask_027):
    export = export_compressed(_student(), tmp_path / "export", load_tokenizer("byte"))
    assert _mode(export) == 0o750  # mkdtemp's 0700 before
    assert {_mode(p) for p in export.iterdir()} == {0o640}


def test_summary_json_is_replaced_whole_or_not_at_all(tmp_path, umask_027):
    path = atomic_write_json(tmp_path / "summary.json", {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and _mode(path) == 0o640

    class Unserialisable:
        pass

    with pytest.raises(TypeError):
        atomic_write_json(path, {"a": 2, "b": Unserialisable()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_teacher_record_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "teacher_logits.safetensors"
    teacher_logits.save({"x": torch.arange(4.0)}, path, {"format": "t"})
    before = path.read_bytes()

    def partial(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 10)  # a write cut short
        raise Boom("killed")

    monkeypatch.setattr(teacher_logits, "save_file", partial)
    with pytest.raises(Boom):
        teacher_logits.save({"x": torch.arange(8.0)}, path, {"format": "t"})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_export_without_its_manifest_is_refused_naming_what_is_missing(tmp_path):
    run = tmp_path / "run"
    export = export_compressed(_student(), run / "export", load_tokenizer("byte"))
    OmegaConf.save(OmegaConf.create({"task": {"name": "compress"}, "model": {"name": "tiny_qwen3_moe"},
                                     "method": {"name": "sft"}}), run / "config.yaml")
    load_model({"pretrained": str(export)})  # complete: loads
    (export / MANIFEST_FILE).unlink()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (export / name).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match=r"model.pretrained=\S+export: an incomplete export of task=compress"
                                                r".*lacks compress_manifest.json \(or condense_manifest.json\) and "
                                                r"the tokenizer.*Re-run that task"):
        load_model({"pretrained": str(export)})
    with pytest.raises(FileNotFoundError, match=r"task.checkpoint=\S+export: an incomplete export of task=compress"):
        load_for_eval(eval_cfg(tmp_path / "eval", f"task.checkpoint={export}"))
    # a model directory of another task (finetune exports have no manifest) loads as before
    OmegaConf.save(OmegaConf.create({"task": {"name": "finetune"}}), run / "config.yaml")
    load_model({"pretrained": str(export), "tokenizer": "byte"})
