"""The remaining exports go through the one atomic export writer (issue 21 item 6): the condensed export
(task=condense, method=condense_sft) and task=expert_removal's point exports; each carries its manifest, and one
without it is refused by model loading (and so by task=evaluate), naming what is missing. Results tables written
over a study's progress file (points.csv) are replaced whole or not at all."""

from __future__ import annotations

import sys

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.compress import calibrate, condense, export_condensed, load_condensed
from moe_lab.compress.condense import CONDENSE_FILE
from moe_lab.compress.dense import MANIFEST_FILE
from moe_lab.models import load_model
from moe_lab.runs import compress_sweep as sweep
from moe_lab.tasks import run_task
from tests.analysis.test_removal_resume import _cfg as removal_cfg
from tests.conftest import build_tiny, random_batch

condense_module = sys.modules["moe_lab.compress.condense"]  # the package's ``condense`` is the function


class Boom(RuntimeError):
    pass


def _condensed(seed: int = 0):
    model = build_tiny("olmoe", seed=seed).eval()
    cal = calibrate(model, [random_batch(batch=2, seq=12, pad_rows=())])
    return condense(model, cal, [1], {1: [2, 0]})


def test_condensed_export_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    export = export_condensed(_condensed(), tmp_path / "export")
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    assert CONDENSE_FILE in before
    real = condense_module.write_manifest

    def killed(*args, **kwargs):  # the weights of the second export are written, its manifest is not
        raise Boom("killed")

    monkeypatch.setattr(condense_module, "write_manifest", killed)
    with pytest.raises(Boom):
        export_condensed(_condensed(seed=1), export)
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary folder left
    monkeypatch.setattr(condense_module, "write_manifest", real)
    second = _condensed(seed=1)
    reloaded = load_condensed(export_condensed(second, export))
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), second.state_dict().values()))


def _config(run, **cfg) -> None:
    OmegaConf.save(OmegaConf.create(cfg), run / "config.yaml")


def test_condense_sft_export_without_its_manifest_is_refused(tmp_path):
    run = tmp_path / "run"
    export = export_condensed(_condensed(), run / "export")
    _config(run, task={"name": "finetune"}, method={"name": "condense_sft",
                                                                "_target_": "moe_lab.methods.condense_sft.CondenseSFTModule"},
            model={"name": "tiny_olmoe"})
    (export / CONDENSE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"model.pretrained=\S+export: an incomplete export of task=finetune "
                                                r"method=condense_sft .*lacks compress_manifest.json \(or "
                                                r"condense_manifest.json\)"):
        load_model({"pretrained": str(export), "tokenizer": "byte"})


def test_expert_removal_exports_carry_their_manifest_and_are_refused_without(tmp_path):
    cfg = removal_cfg(tmp_path)
    cfg.task.update({"keep_exports": True, "inference_reduce": []})
    run_task(cfg)
    run = tmp_path / "run"
    base, point = run / "points" / "base" / "export", run / "points" / "small_dense_n3_k3_es_act" / "export"
    assert OmegaConf.load(base / MANIFEST_FILE)["method"] == "none"
    assert OmegaConf.load(point / MANIFEST_FILE) == OmegaConf.load(point.parent / "manifest.json")
    assert not [p for p in (run / "points").rglob(".*tmp*")]
    _config(run, task={"name": "expert_removal"}, model={"name": "tiny_olmoe"}, method={"name": "sft"})
    load_model({"pretrained": str(point), "tokenizer": "byte"})  # complete: loads
    for export in (base, point):
        (export / MANIFEST_FILE).unlink()
        with pytest.raises(FileNotFoundError, match=rf"model.pretrained={export}: an incomplete export of "
                                                    rf"task=expert_removal \(run {run}\)"):
            load_model({"pretrained": str(export), "tokenizer": "byte"})


def test_a_grid_killed_while_writing_its_tables_keeps_its_points(tmp_path, monkeypatch):
    """write_grid rewrites points.csv (the progress file a re-run reads): a kill in the middle keeps the old one."""
    points = pd.DataFrame([{"score": "sf", "grouping": "rr", "scaling": "none", "K": k, "ppl": 10.0 + k,
                            "nll": 1.0, "status": "ok", "seconds": 0.1} for k in (1, 2)])
    sweep.write_grid(points, tmp_path)
    before = (tmp_path / "points.csv").read_bytes()
    real = pd.DataFrame.to_csv

    def torn(self, path=None, *args, **kwargs):  # half the rows written, then killed
        real(self.iloc[:1], path, *args, **kwargs)
        raise Boom("killed")

    monkeypatch.setattr(pd.DataFrame, "to_csv", torn)
    with pytest.raises(Boom):
        sweep.write_grid(pd.concat([points, points.iloc[:1].assign(K=3)]), tmp_path)
    assert (tmp_path / "points.csv").read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))
