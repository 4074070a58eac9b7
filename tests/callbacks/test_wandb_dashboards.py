"""W&B dashboard media, read back from offline run files: expert-load heatmaps over time, Lorenz curves and the
per-layer Gini table, the export artifact, the sweep summary table and the sweep's W&B group."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest

wandb = pytest.importorskip("wandb")
from lightning.pytorch.loggers import WandbLogger
from omegaconf import OmegaConf
from wandb.proto import wandb_internal_pb2

from moe_lab.callbacks import ExpertLoadCallback
from moe_lab.callbacks.wandb_media import WandbMediaCallback, sweep_group
from moe_lab.sweep_summary import COLUMNS, log_sweep_table, sweep_rows

from .conftest import REPO, TinyModule, loader, random_batches
from .test_wandb_offline import history_rows, read_records


def _records(run_dir, kind):
    (log,) = run_dir.glob("run-*.wandb")
    out = []
    for raw in read_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == kind:
            out.append(getattr(record, kind))
    return out


def _table(run_dir, row, key) -> dict:
    """A logged wandb.Table (history rows hold it flattened: ``<key>/_type``, ``<key>/path``)."""
    assert row[f"{key}/_type"] == "table-file"
    return json.loads((run_dir / "files" / row[f"{key}/path"]).read_text())


def _gini_by_pairs(counts) -> float:
    """Gini as the mean absolute difference over all expert pairs / (2 x mean), with Python floats."""
    x = [float(c) for c in counts]
    mean = sum(x) / len(x)
    return sum(abs(a - b) for a in x for b in x) / (2 * len(x) ** 2 * mean)


class Totals(L.Callback):
    """Every layer's monotonic total_counts after each optimizer step (and at the start)."""

    def __init__(self):
        self.at = {}

    def _take(self, trainer, pl_module):
        self.at[trainer.global_step] = {layer.index: layer.total_counts.clone() for layer in pl_module.patch.layers}

    def on_train_start(self, trainer, pl_module):
        self._take(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._take(trainer, pl_module)


def test_heatmaps_lorenz_gini_and_export_artifact(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="moe-lab-test", name="dash")
    totals = Totals()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=4, logger=logger, log_every_n_steps=1, default_root_dir=tmp_path,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[totals, ExpertLoadCallback(log_every_n_steps=2, heatmap_every_n_steps=2),
                   WandbMediaCallback(log_export=True)],
    )
    module = TinyModule()
    try:
        trainer.fit(module, loader(random_batches(4)))
        module.patch.export(tmp_path / "export")
    finally:
        wandb.finish()

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = history_rows(run_dir)
    # one heatmap per snapshot on the step axis (W&B's image step slider), plus the Lorenz figure of the window
    heat = [r for r in rows if r.get("load/heatmap/_type") == "images/separated"]
    lorenz = [r for r in rows if r.get("load/lorenz/_type") == "image-file"]
    assert [r["trainer/global_step"] for r in heat] == [1, 3]
    assert [r["trainer/global_step"] for r in lorenz] == [1, 3]
    assert len(list((run_dir / "files" / "media" / "images").rglob("*.png"))) == 4
    # per-layer Gini of each heatmap window, against the pairwise formula on independently captured counts
    for row, (start, end) in zip(lorenz, [(0, 2), (2, 4)]):
        table = _table(run_dir, row, "load/gini_by_layer")
        assert table["columns"][:2] == ["layer", "gini"]
        assert len(table["data"]) == len(module.patch.layers)
        for layer, gini, *_rest, assignments in table["data"]:
            window = totals.at[end][layer] - totals.at[start][layer]
            assert assignments == int(window.sum())
            assert gini == pytest.approx(_gini_by_pairs(window), rel=1e-12)
    # the export (merged model) as a W&B model artifact of the run
    (artifact,) = [a for a in _records(run_dir, "artifact") if a.type == "model"]  # (tables are artifacts too)
    assert artifact.name == "dash-export"
    assert "model.safetensors" in {entry.path for entry in artifact.manifest.contents}


def test_sweep_summary_table_in_the_sweep_group(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sweep = tmp_path / "2026-01-01_00-00-00"
    jobs = {"0_tiny_olmoe_sft": {"model": "tiny_olmoe", "method": "sft", "global_step": 3, "train/loss": 5.5,
                                 "val/loss": 5.0, "step_time_median_s": 0.2},
            "1_tiny_olmoe_esft": {"model": "tiny_olmoe", "method": "esft", "global_step": 3, "train/loss": 5.25,
                                  "val/loss": 4.5, "step_time_median_s": 0.1}}
    for job, summary in jobs.items():
        (sweep / job).mkdir(parents=True)
        (sweep / job / "summary.json").write_text(json.dumps(summary))
    config = OmegaConf.create({"logger": {"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger"},
                                          "wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger",
                                                    "project": "moe-lab-test"}}})
    try:
        run_dir = log_sweep_table(config, sweep)
    finally:
        wandb.finish()
    assert run_dir is not None
    (row,) = [r for r in history_rows(run_dir) if "sweep/summary/path" in r]  # waits for the complete log
    (run,) = _records(run_dir, "run")
    assert run.run_group == sweep.name and run.job_type == "sweep_summary"
    table = _table(run_dir, row, "sweep/summary")
    assert table["columns"] == list(COLUMNS)
    assert table["data"] == [[r[c] for c in COLUMNS] for r in sweep_rows(sweep)]
    by_method = {d[2]: dict(zip(COLUMNS, d)) for d in table["data"]}
    assert by_method["esft"]["step_ratio"] == 0.5 and by_method["esft"]["val_ppl"] == pytest.approx(math.exp(4.5))
    # without a W&B logger nothing is logged
    assert log_sweep_table(OmegaConf.create({"logger": {"csv": {"_target_": "x.CSVLogger"}}}), sweep) is None


def test_wandb_group_is_the_sweep_dir_name_in_a_multirun(monkeypatch):
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from moe_lab.sweep_summary import SweepSummaryCallback

    monkeypatch.setenv("WANDB_RUN_GROUP", "")  # restored (to unset) after the test
    monkeypatch.delenv("WANDB_RUN_GROUP")
    assert sweep_group("finetune") == "finetune"  # no Hydra run: the default
    wandb_yaml = OmegaConf.load(REPO / "conf" / "logger" / "wandb.yaml")
    node = OmegaConf.merge({"task": {"name": "finetune"}}, {"logger": wandb_yaml})
    hydra = SimpleNamespace(mode=RunMode.RUN, sweep=SimpleNamespace(dir="multirun/finetune/2026-01-01_00-00-00"))
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra))
    SweepSummaryCallback().on_job_start(config=node)
    assert node.logger.wandb.group == "finetune"  # a single run: the task's name
    hydra.mode = RunMode.MULTIRUN
    SweepSummaryCallback().on_job_start(config=node)
    assert node.logger.wandb.group == "2026-01-01_00-00-00"  # a sweep's job: the sweep directory's name
