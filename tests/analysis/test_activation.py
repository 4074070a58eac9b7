"""task=activation_stats: Gini / Lorenz reference values, tail share by hand, the task on a real calibration."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.analysis.activation import layer_stats, lorenz, shares, tail_share
from tests.conftest import ROOT, build_tiny, random_batch, tiny_model_cfg


def test_reference_values():
    _, summary = layer_stats({0: torch.tensor([1, 1, 1, 1]), 1: torch.tensor([4, 0, 0, 0])}, 0.02)
    rows, _ = layer_stats({0: torch.tensor([1, 1, 1, 1]), 1: torch.tensor([4, 0, 0, 0])}, 0.02)
    assert rows[0]["gini"] == 0 and rows[1]["gini"] == pytest.approx(0.75)
    assert summary["gini_mean"] == pytest.approx(0.375)
    # pooled over 8 (layer, expert) shares [.25]*4 + [1, 0, 0, 0]: Gini by the definition sum|xi-xj|/(2 n^2 mean)
    x = np.array([0.25] * 4 + [1, 0, 0, 0])
    assert summary["gini_pooled"] == pytest.approx(np.abs(x[:, None] - x[None]).sum() / (2 * 64 * x.mean()))


def test_lorenz_and_scale_invariance():
    x, y = lorenz(torch.tensor([3, 1, 0, 4]))
    assert np.allclose(x, [0, 0.25, 0.5, 0.75, 1]) and np.allclose(y, [0, 0, 1 / 8, 4 / 8, 1])
    assert torch.allclose(shares(torch.tensor([3, 1, 0, 4])), shares(torch.tensor([30, 10, 0, 40])))


def test_tail_share_by_hand():
    share, frac = tail_share(torch.tensor([97, 1, 1, 1]), tau=0.02)
    assert share == pytest.approx(0.03) and frac == 0.75


def test_task_on_a_calibration(tmp_path):
    from moe_lab.compress.calibration import calibrate
    from moe_lab.tasks import run_task

    model = build_tiny("qwen2_moe")
    batch = random_batch(batch=4, seq=12)
    cal = calibrate(model, [{k: batch[k] for k in ("input_ids", "attention_mask")}])
    path = cal.save(tmp_path / "calibration.safetensors")
    out = tmp_path / "run"
    out.mkdir()
    cfg = OmegaConf.create({"task": OmegaConf.load(ROOT / "conf" / "task" / "activation_stats.yaml")["task"],
                            "model": tiny_model_cfg("qwen2_moe"), "paths": {"output_dir": str(out)}, "logger": None})
    cfg.task.runs = {"base": str(path), "densemixer": str(path)}
    cfg.task.all_experts_runs = ["densemixer"]
    summary = run_task(cfg)
    real = int(batch["attention_mask"].sum())
    for stats in cal.layers.values():
        assert int(stats["count"].sum()) == real * model.config.num_experts_per_tok
    assert summary["activation/densemixer/gini_pooled"] == pytest.approx(0, abs=1e-12)
    assert summary["activation/base/gini_mean"] > 0
    assert (out / "activation.png").stat().st_size > 10_000 and (out / "activation_heatmap.png").is_file()
    cfg.task.all_experts_runs = ["sft"]
    with pytest.raises(ValueError, match="task.all_experts_runs"):
        run_task(cfg)


def test_task_counts_the_model_on_a_dataset(tmp_path):
    """No task.runs: the model counted on task.dataset under its own (here plain top-k) routing; counts = real
    tokens x k per layer."""
    import csv

    from hydra import compose, initialize_config_dir

    from moe_lab.tasks import run_task

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["task=activation_stats", "model=tiny_qwen2_moe",
                                           "dataset@task.dataset=synthetic_math", "task.calibration.num_sequences=6",
                                           "task.dataset.num_examples=40", f"paths.output_dir={tmp_path}",
                                           "logger=none"])
    summary = run_task(cfg)
    with open(tmp_path / "activation_counts.csv") as f:
        rows = list(csv.DictReader(f))
    per_layer = {}
    for r in rows:
        per_layer[r["layer"]] = per_layer.get(r["layer"], 0) + int(r["selections"])
    with open(tmp_path / "activation_layers.csv") as f:
        assignments = {r["layer"]: int(r["assignments"]) for r in csv.DictReader(f)}
    assert sorted(per_layer) == ["0", "2"] and per_layer == assignments  # layer 1 is dense
    assert len(set(per_layer.values())) == 1 and per_layer["0"] % 2 == 0  # every real token picks k = 2
    assert 0 < summary["activation/tiny_qwen2_moe/gini_mean"] < 1
    assert (tmp_path / "activation_heatmap.png").is_file()
    assert "family top-k" in (tmp_path / "activation.md").read_text()
