"""RouterBiasCallback: statistics vs the bias buffers, the trajectory files vs the biases recorded at every
optimizer step, condenser marking, resume, no-op for methods without biases, W&B offline read-back."""

from __future__ import annotations

import csv
import math

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import moe_lab
from moe_lab.analysis.bias_plots import BiasTrajectory, bias_trajectory_plot
from moe_lab.callbacks import RouterBiasCallback, RoutingDriftCallback
from moe_lab.callbacks.router_bias import router_bias_metrics
from moe_lab.methods.base import MoELightningModule
from tests.conftest import build_tiny

from .conftest import TinyModule, loader, metric_by_step, random_batches, read_csv_metrics

CONDENSER = {"gamma": 1e-2, "n": 1, "selection": "in_run", "selection_updates": 3}


def ref_stats(values: list[float]) -> dict[str, float]:
    return {
        "min": min(values),
        "max": max(values),
        "mean": sum(values) / len(values),
        "norm": math.sqrt(sum(v * v for v in values)),
    }


def condenser_module(lr=1e-3):
    return MoELightningModule(build_tiny("olmoe"), method="condenser", options=CONDENSER, optim={"lr": lr})


class BiasRecorder(L.Callback):
    """The biases (float32 copies) and condensers after every optimizer step, and at the start."""

    def __init__(self):
        self.biases: dict[int, list[torch.Tensor]] = {}
        self.forced: dict[int, list[list[int]]] = {}
        self._seen = None

    def _take(self, pl_module, step):
        self.biases[step] = [layer.bias.detach().clone() for layer in pl_module.patch.layers]
        self.forced[step] = [layer.forced_experts for layer in pl_module.patch.layers]

    def on_train_start(self, trainer, pl_module):
        self._seen = trainer.global_step
        self._take(pl_module, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self._seen:
            self._seen = trainer.global_step
            self._take(pl_module, trainer.global_step)


def fit(module, tmp_path, callbacks, max_steps, accumulate=1, ckpt_path=None, logger=None):
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        logger=logger or CSVLogger(tmp_path),
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, loader(random_batches(max_steps * accumulate)), ckpt_path=ckpt_path)
    return trainer


def test_metrics_match_the_bias_buffers():
    patch = moe_lab.apply(build_tiny("olmoe"), "condenser", n=1, selection="in_run", selection_updates=3)
    hand = {0: [0.5, -0.25, 0.125, 0.0, 1.0, -1.5, 0.3, 0.2], 1: [-0.01, 0.02, 0.0, 0.0, 0.07, -0.03, 0.04, 0.01]}
    for layer in patch.layers:
        layer.bias.copy_(torch.tensor(hand[layer.index]))
    got = router_bias_metrics(patch.layers)
    as_f32 = {i: torch.tensor(v).tolist() for i, v in hand.items()}  # the buffers hold float32
    expected = {f"router_bias/layer{i}/{k}": v for i, vals in as_f32.items() for k, v in ref_stats(vals).items()}
    expected.update({f"router_bias/{k}": v for k, v in ref_stats(as_f32[0] + as_f32[1]).items()})
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert got["router_bias/min"] == pytest.approx(-1.5) and got["router_bias/layer1/max"] == pytest.approx(0.07)


def test_no_biases_no_output(tmp_path):
    callback = RouterBiasCallback(log_every_n_steps=1, plot_every_n_steps=1)
    fit(TinyModule(), tmp_path, [callback], max_steps=2)  # sft: no bias buffers
    assert callback.latest == {} and callback.latest_plot is None
    assert not (tmp_path / "plots").exists()
    rows = read_csv_metrics(next(tmp_path.glob("lightning_logs/version_*/metrics.csv")))
    assert not any(key.startswith("router_bias/") for row in rows for key in row)


@pytest.fixture(scope="module")
def condenser_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router_bias")
    callback = RouterBiasCallback(log_every_n_steps=2, record_every_n_steps=3, plot_every_n_steps=4)
    recorder = BiasRecorder()
    module = condenser_module()
    fit(module, tmp, [callback, recorder], max_steps=8, accumulate=2)
    rows = read_csv_metrics(next(tmp.glob("lightning_logs/version_*/metrics.csv")))
    return {"tmp": tmp, "callback": callback, "recorder": recorder, "module": module, "rows": rows}


def test_logged_stats_are_those_of_the_biases_after_each_logged_step(condenser_run):
    rows, recorded = condenser_run["rows"], condenser_run["recorder"].biases
    for step in (2, 4, 6, 8):  # optimizer step s is logged at Lightning's step s - 1, like train/loss
        layers = [b.tolist() for b in recorded[step]]
        for i, values in enumerate(layers):
            for name, value in ref_stats(values).items():
                logged = metric_by_step(rows, f"router_bias/layer{i}/{name}")
                assert sorted(logged) == [1, 3, 5, 7]
                assert logged[step - 1] == pytest.approx(value, rel=1e-12, abs=1e-15), (step, i, name)
        for name, value in ref_stats(layers[0] + layers[1]).items():
            assert metric_by_step(rows, f"router_bias/{name}")[step - 1] == pytest.approx(value, abs=1e-15)
    assert recorded[8][0].abs().max() > 0  # the biases did move


def test_trajectory_csv_holds_the_biases_at_the_recorded_steps(condenser_run):
    recorder, module = condenser_run["recorder"], condenser_run["module"]
    path = condenser_run["tmp"] / "plots" / "router_bias_trajectory.csv"
    traj = BiasTrajectory.from_csv(path)
    # start, every 3rd step (3 is also the condenser choice), and the end
    assert traj.steps == [0, 3, 6, 8]
    for row, step in enumerate(traj.steps):
        for layer in (0, 1):
            assert np.array_equal(traj.biases[layer][row], recorder.biases[step][layer].numpy()), (step, layer)
    # the condensers appear at step 3 (selection_updates) and are marked from then on
    assert [recorder.forced[s] for s in (2, 3)] == [[[], []], [layer.forced_experts for layer in module.patch.layers]]
    chosen = {layer.index: layer.forced_experts for layer in module.patch.layers}
    assert traj.condensers == chosen and traj.chosen_at == {0: 3, 1: 3}
    assert condenser_run["callback"].chosen_at == {0: 3, 1: 3}
    with open(path, newline="") as f:
        flagged = {(int(r["step"]), int(r["layer"]), int(r["expert"])) for r in csv.DictReader(f) if r["condenser"] == "1"}
    assert flagged == {(s, layer, e) for s in (3, 6, 8) for layer, ids in chosen.items() for e in ids}


def test_trajectory_plot_written(condenser_run):
    plot = condenser_run["tmp"] / "plots" / "router_bias_trajectory.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert condenser_run["callback"].latest_plot == plot
    assert sorted(p.name for p in plot.parent.iterdir()) == ["router_bias_trajectory.csv", "router_bias_trajectory.png"]


def test_plot_from_csv_round_trip(tmp_path):
    traj = BiasTrajectory(
        steps=[0, 5, 10],
        biases={3: np.array([[0, 0, 0], [0.1, -0.1, 0.0], [0.2, -0.3, 0.1]], dtype=np.float32)},
        condensers={3: [1]},
        chosen_at={3: 5},
    )
    back = BiasTrajectory.from_csv(traj.to_csv(tmp_path / "t.csv"))
    assert back.steps == traj.steps and back.condensers == {3: [1]} and back.chosen_at == {3: 5}
    assert np.array_equal(back.biases[3], traj.biases[3])
    assert bias_trajectory_plot(back, tmp_path / "t.png").stat().st_size > 0
    (tmp_path / "bad.csv").write_text("step,layer\n0,0\n")
    with pytest.raises(ValueError, match="missing columns"):
        BiasTrajectory.from_csv(tmp_path / "bad.csv")


def test_resume_continues_the_trajectory_with_the_choice_step(tmp_path):
    """Oracle: the biases after every step, copied by BiasRecorder in the first fit (steps 0-4) and the resumed one
    (4-6). The trajectory written after the resume covers the whole run, the choice step (3) included, once each."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=4)
    first = BiasRecorder()
    fit(condenser_module(), tmp_path, [RouterBiasCallback(log_every_n_steps=1, record_every_n_steps=1), first, ckpt],
        max_steps=4)
    callback, recorder, module = RouterBiasCallback(log_every_n_steps=1, record_every_n_steps=1), BiasRecorder(), condenser_module()
    fit(module, tmp_path, [callback, recorder, ModelCheckpoint(dirpath=tmp_path / "ckpt2")], max_steps=6,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    traj = BiasTrajectory.from_csv(tmp_path / "plots" / "router_bias_trajectory.csv")
    assert traj.steps == [0, 1, 2, 3, 4, 5, 6]
    assert traj.chosen_at == {0: 3, 1: 3} == callback.chosen_at
    assert traj.condensers == {layer.index: layer.forced_experts for layer in module.patch.layers}
    for row, step in enumerate(traj.steps):
        biases = (first if step <= 4 else recorder).biases[step]
        assert np.array_equal(traj.biases[0][row], biases[0].numpy()), step


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="log_every_n_steps"):
        RouterBiasCallback(log_every_n_steps=-1)
    with pytest.raises(ValueError, match="record_every_n_steps"):
        RouterBiasCallback(record_every_n_steps=0)


def test_wandb_offline_run_contains_bias_and_drift(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    from .test_wandb_offline import history_rows

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="moe-lab-test")
    try:
        fit(condenser_module(), tmp_path, [RouterBiasCallback(log_every_n_steps=2, plot_every_n_steps=2),
                                           RoutingDriftCallback(every_n_steps=2)], max_steps=4, logger=logger)
    finally:
        wandb.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = history_rows(run_dir)
    bias_rows = [r for r in rows if "router_bias/layer0/min" in r]
    assert [r["trainer/global_step"] for r in bias_rows] == [1, 3]
    assert {"router_bias/norm", "router_bias/layer1/max"} <= set(bias_rows[0])
    assert bias_rows[0]["router_bias/layer0/histogram/_type"] == "histogram"
    drift_rows = [r for r in rows if "drift/layer0/topk_overlap" in r]
    assert [r["trainer/global_step"] for r in drift_rows] == [1, 3]
    assert {"drift/flip_rate_mean", "drift/layer1/entropy", "drift/kl_mean"} <= set(drift_rows[0])
    images = [r for r in rows if r.get("router_bias/trajectory/_type") == "images/separated"]
    assert len(images) == 2  # steps 2 and 4; step 4 ends training: one image, the end's
