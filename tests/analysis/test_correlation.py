"""task=correlation: Pearson against numpy.corrcoef, invariances, hand-made deltas, refusals, the task."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.analysis.correlation import check_same_architecture, deltas, pearson, signature, summarise
from tests.conftest import ROOT, build_tiny, tiny_model_cfg


def test_pearson_matches_numpy():
    down = torch.randn(6, 5, 7, generator=torch.Generator().manual_seed(0))
    expected = np.corrcoef(down.reshape(6, -1).numpy().astype(np.float64))
    assert np.allclose(pearson(down).numpy(), expected, atol=1e-12)


def test_pearson_invariances():
    down = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    c = pearson(down)
    assert torch.allclose(c.diagonal(), torch.ones(4, dtype=torch.float64), atol=1e-14)
    assert torch.allclose(pearson(3.0 * down + 2.5), c, atol=1e-12)


def test_deltas_by_hand_and_zero_base_skipped():
    base = {1: torch.tensor([[1.0, 0.5, -0.5, 0.0], [0.5, 1, 0.2, 0.1], [-0.5, 0.2, 1, 0.3], [0.0, 0.1, 0.3, 1]],
                            dtype=torch.float64)}
    tuned = base[1].clone()
    tuned[0, 1], tuned[0, 2], tuned[0, 3] = 0.6, -0.4, 0.9
    rows, skipped = deltas(base, {"condenser": {1: tuned}, "esft": {1: base[1]}}, {1: [0]})
    got = {(r["method"], r["expert"]): r["delta_pct"] for r in rows}
    assert skipped == 2  # (0, 3) for both methods
    assert got[("condenser", 1)] == pytest.approx(20.0) and got[("condenser", 2)] == pytest.approx(20.0)
    assert got[("esft", 1)] == 0 and got[("esft", 2)] == 0


def test_summary_mean_and_population_std():
    rows = [{"method": "m", "layer": layer, "condenser": 0, "expert": j, "delta_pct": v}
            for layer, values in ((1, [1.0, 3.0]), (2, [5.0, 7.0]), (3, [0.0, 0.0])) for j, v in enumerate(values)]
    layers, model = summarise(rows)
    assert [r["delta_pct"] for r in layers] == [2.0, 6.0, 0.0]
    assert model[0]["mean"] == pytest.approx(np.mean([2, 6, 0]))
    assert model[0]["std"] == pytest.approx(np.std([2, 6, 0]))


def test_different_expert_counts_are_refused_naming_both():
    a = signature(build_tiny("olmoe"), "task.checkpoints.base=/a")
    b = signature(build_tiny("olmoe", num_experts=4), "task.checkpoints.esft=/b")
    with pytest.raises(ValueError, match=r"task.checkpoints.base=/a .* vs task.checkpoints.esft=/b"):
        check_same_architecture(a, b)
    c = signature(build_tiny("mixtral"), "task.checkpoints.condenser=/c")
    with pytest.raises(ValueError, match="olmoe.*mixtral"):
        check_same_architecture(a, c)


def test_task_end_to_end(tmp_path):
    from moe_lab.moe.view import find_moe_layers
    from moe_lab.tasks import run_task

    paths = {}
    for i, name in enumerate(("base", "esft", "condenser")):
        model = build_tiny("olmoe")
        if i:
            with torch.no_grad():
                for v in find_moe_layers(model):
                    v.down_proj.add_(0.02 * i * torch.randn(v.down_proj.shape, generator=torch.Generator().manual_seed(i)))
        model.save_pretrained(tmp_path / name)
        paths[name] = str(tmp_path / name)
    out = tmp_path / "run"
    out.mkdir()
    cfg = OmegaConf.create({"task": OmegaConf.load(ROOT / "conf" / "task" / "correlation.yaml")["task"],
                            "model": tiny_model_cfg("olmoe"), "paths": {"output_dir": str(out)}, "logger": None})
    cfg.task.checkpoints = paths
    cfg.task.condensers = {0: [2, 5], 1: [0, 1]}
    summary = run_task(cfg)
    assert (out / "correlation.png").stat().st_size > 10_000
    rows = (out / "correlation.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 * 2 * 6 - summary["correlation/skipped_pairs"]
    assert set(json.loads((out / "summary.json").read_text())) >= {"correlation/esft/mean", "correlation/condenser/std"}
