"""The MoE -> dense diagnostics (Figs. 2-4): selection overlap against set arithmetic on independently ranked
scores, effective rank against closed forms on a diagonal Gram, marginal means against the paper's own Fig. 4
numbers from its Table 12, and task=dense_diagnostics end to end on a tiny model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from moe_lab.compress import calibrate
from moe_lab.compress.diagnostics import effective_ranks, marginal_means, read_results, selection_overlap
from moe_lab.compress.scores import scores
from tests.compress.test_scores import hand_calibration
from tests.conftest import ROOT, build_tiny, random_batch


def _calibration():
    model = build_tiny("qwen3_moe").eval()
    return calibrate(model, [random_batch(batch=3, seq=16, seed=s, pad_rows=()) for s in range(2)])


def test_selection_overlap_is_the_layer_mean_of_set_overlaps():
    cal = _calibration()
    names = ["sf", "pp", "cp", "acp"]
    K = 3
    top = {}
    for s in names:  # independent ranking: numpy's stable argsort of the negated score (ties to the lower index)
        top[s] = {layer: set(np.argsort(-v.numpy(), kind="stable")[:K].tolist()) for layer, v in scores(cal, s).items()}
    got = selection_overlap(cal, names, K)
    jac = selection_overlap(cal, names, K, measure="jaccard")
    for a in names:
        for b in names:
            per_layer = [(top[a][i], top[b][i]) for i in cal.layers]
            assert got.loc[a, b] == pytest.approx(np.mean([len(x & y) / K for x, y in per_layer]), abs=1e-15)
            assert jac.loc[a, b] == pytest.approx(np.mean([len(x & y) / len(x | y) for x, y in per_layer]), abs=1e-15)
    assert (np.diag(got.to_numpy()) == 1).all()
    with pytest.raises(ValueError, match="task.overlap_measure='dice'"):
        selection_overlap(cal, names, K, measure="dice")


def _erank(d):
    q = [x / sum(d) for x in d if x > 0]
    return math.exp(-sum(x * math.log(x) for x in q))


def test_effective_rank_closed_form_on_a_diagonal_gram():
    """Hand calibration: diagonal Gram with v = sq_norm / n = [4, 9, 1, 16], CP = [.4, .4, .3, 0],
    ACP = [.8, 1.2, .3, 0]: K_S = diag(I_e v_e) on the selected experts, erank = exp(-sum q log q)."""
    ranks = effective_ranks(hand_calibration(), [2, 3]).set_index(["method", "K"]).erank
    assert ranks["cp", 2] == pytest.approx(_erank([0.4 * 4, 0.4 * 9]), rel=1e-12)         # top-2 CP: experts 0, 1
    assert ranks["do_cp", 2] == pytest.approx(_erank([0.4 * 4, 0.4 * 9]), rel=1e-12)      # diag: top K_ee = 1, 0
    assert ranks["acp", 3] == pytest.approx(_erank([0.8 * 4, 1.2 * 9, 0.3 * 1]), rel=1e-12)
    assert ranks["do_acp", 3] == pytest.approx(_erank([0.8 * 4, 1.2 * 9, 0.3 * 1]), rel=1e-12)


def test_marginal_means_reproduce_the_papers_figure_4():
    results = read_results(ROOT / "experiments" / "moe_to_dense" / "reported.csv")
    assert len(results) == 35
    by_score, by_grouping = marginal_means(results)
    paper_score = {"sf": 37.25, "pp": 36.94, "ps": 37.06, "cp": 40.18, "acp": 40.69, "do_cp": 42.40, "do_acp": 42.64}
    paper_grouping = {"rr": 40.08, "wc": 39.70, "rc": 39.64, "ab": 38.92, "oc": 39.63}
    assert {k: round(v, 2) for k, v in by_score.items()} == paper_score
    assert {k: round(v, 2) for k, v in by_grouping.items()} == paper_grouping
    with pytest.raises(ValueError, match="twice"):
        marginal_means(results.iloc[[0, 0]])


def test_task_writes_csv_png_and_summary(tmp_path):
    from moe_lab.tasks import run_task

    cal = _calibration()
    cal.save(tmp_path / "cal.safetensors")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["task=dense_diagnostics", f"paths.output_dir={tmp_path / 'run'}",
                                           f"task.calibration_file={tmp_path / 'cal.safetensors'}",
                                           f"task.results={ROOT / 'experiments' / 'moe_to_dense' / 'reported.csv'}"])
    summary = run_task(cfg)
    run = tmp_path / "run"
    for name in ("selection_overlap.csv", "selection_overlap.png", "effective_rank.csv", "effective_rank.png",
                 "marginal_means_score.csv", "marginal_means_grouping.csv", "marginal_means.png"):
        assert (run / name).stat().st_size > 0, name
    assert summary["overlap"]["K"] == 2 and json.loads((run / "summary.json").read_text())["top_k"] == 2
    assert set(summary["effective_rank"]) == {f"{m}/K{K}" for m in ("cp", "do_cp", "acp", "do_acp") for K in (2, 4, 8)}
    assert all(1 - 1e-9 <= v <= int(key.split("K")[-1]) + 1e-9 for key, v in summary["effective_rank"].items())
    assert summary["marginal_means"]["score"]["do_acp"] == pytest.approx(42.642, abs=1e-3)
    assert torch.isfinite(torch.tensor(list(summary["effective_rank"].values()))).all()


def test_figure_titles_name_the_calibration_file_not_its_folder(tmp_path, monkeypatch):
    """The plots' titles print the calibration file's name (and a local model folder's name), never an absolute
    path."""
    import matplotlib.axes
    import matplotlib.figure

    from moe_lab.tasks import run_task
    from moe_lab.tasks.dense_diagnostics import figure_title

    titles = []
    for cls, name in ((matplotlib.axes.Axes, "set_title"), (matplotlib.figure.Figure, "suptitle")):
        original = getattr(cls, name)
        def record(self, text, *args, _draw=original, **kwargs):
            titles.append(text)
            return _draw(self, text, *args, **kwargs)

        monkeypatch.setattr(cls, name, record)
    cal = _calibration()
    cal.save(tmp_path / "cal.safetensors")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["task=dense_diagnostics", f"paths.output_dir={tmp_path / 'run'}",
                                           f"task.calibration_file={tmp_path / 'cal.safetensors'}"])
    run_task(cfg)
    assert len(titles) >= 2 and all(str(tmp_path) not in t for t in titles), titles
    assert all("cal.safetensors" in t for t in titles), titles
    assert figure_title("/local/models/Qwen3-30B-A3B", "/runs/x/calibration.safetensors") == \
        "Qwen3-30B-A3B (calibration.safetensors)"
    assert figure_title("Qwen/Qwen3-30B-A3B", "c.safetensors") == "Qwen/Qwen3-30B-A3B (c.safetensors)"
