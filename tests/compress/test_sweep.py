"""One-process sweeps (spec 2.12, A2-14): every point equals an independently converted student, failed
points are recorded, the paper-layout grid marks the row minimum, task=compress composes from Hydra."""

from __future__ import annotations

import copy
import functools
import math

import pandas as pd
import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir

from moe_lab.compress import calibrate
from moe_lab.compress.dense import to_dense
from moe_lab.compress.prune import prune_experts
from moe_lab.data.tokenizer import load_tokenizer
from moe_lab.runs.compress_sweep import (
    dense_sweep,
    format_ppl,
    grid_markdown,
    grid_table,
    ppl_point,
    prune_study,
    write_grid,
    write_prune_study,
)
from tests.conftest import ROOT, build_tiny, random_batch

IDS = [3 + (7 * i) % 300 for i in range(96)]
PPL = {"max_length": 48, "stride": 48}


@pytest.fixture(autouse=True)
def _one_thread():
    """Sweeps run hundreds of tiny forwards: one intra-op thread avoids oversubscription stalls on a shared CPU
    (every comparison below is made at the same thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _setup():
    model = build_tiny("qwen3_moe").eval()
    calibration = calibrate(model, [random_batch(batch=4, seq=24, seed=s, pad_rows=()) for s in range(2)])
    return model, calibration, load_tokenizer("byte")


def test_every_sweep_point_equals_a_fresh_conversion():
    model, calibration, tok = _setup()
    points = dense_sweep(model, tok, calibration, IDS, scores=["sf", "do_acp"], groupings=["rr", "oc", "ab"],
                         scalings=["uniform", "proportional"], Ks=[2, 5], **PPL)
    assert len(points) == 2 * 3 * 2 * 2 and (points.status == "ok").all()
    for row in points.iloc[[0, 5, 11, 17, 23]].itertuples():
        student = to_dense(model, calibration, score=row.score, grouping=row.grouping, scaling=row.scaling, K=row.K)
        assert ppl_point(student, tok, IDS, **PPL)["ppl"] == row.ppl
    # K = k: grouping is irrelevant (every grouping row has the same K=2 value within a score and scaling)
    k2 = points[points.K == 2].groupby(["score", "scaling"]).ppl.nunique()
    assert (k2 == 1).all()


def test_failed_points_are_recorded_not_fatal():
    model, calibration, tok = _setup()
    broken = copy.deepcopy(calibration)
    for stats in broken.layers.values():  # zero outputs: the D-optimal lambda is 0 -> selection error
        stats["gram"].zero_()
        stats["sq_norm"].zero_()
    bad_model = copy.deepcopy(model)
    with torch.no_grad():  # an infinite expert weight: every student that keeps expert 0 has NaN logits
        for layer in bad_model.model.layers[1:]:
            layer.mlp.experts.down_proj[0].fill_(float("inf"))
    points = dense_sweep(bad_model, tok, broken, IDS, scores=["do_acp", "sf"], groupings=["rr"],
                         scalings=["uniform"], Ks=[8], **PPL)
    by_score = points.set_index("score")
    assert by_score.loc["do_acp", "status"].startswith("error:") and "lambda" in by_score.loc["do_acp", "status"]
    assert by_score.loc["sf", "status"] == "nan" and math.isnan(by_score.loc["sf", "ppl"])


def test_grid_layout_row_minimum_and_non_finite_cells(tmp_path):
    rows = []
    values = {("sf", "rr", "uniform"): [20633.0, 19440.0, float("nan")],
              ("sf", "rr", "proportional"): [21074.0, float("inf"), 2.18e7],
              ("acp", "oc", "uniform"): [float("nan"), float("nan"), float("inf")]}
    for (s, g, sc), ppls in values.items():
        for K, p in zip((8, 16, 128), ppls):
            rows.append({"score": s, "grouping": g, "scaling": sc, "K": K, "ppl": p, "status": "ok"})
    points = pd.DataFrame(rows)
    table = grid_table(points)
    assert list(table.index) == list(values)  # sweep order, not alphabetical
    assert table["best_K"].tolist()[:2] == [16, 8] and pd.isna(table["best_K"].iloc[2])
    md = grid_markdown(table)
    assert "| sf | rr | uniform | 20,633 | **19,440** | nan |" in md
    assert "| sf | rr | proportional | **21,074** | inf | 2.18e+07 |" in md
    assert "| acp | oc | uniform | nan | nan | inf |" in md
    files = write_grid(points, tmp_path)
    assert all(p.is_file() for p in files.values()) and files["heatmap"].stat().st_size > 10_000
    assert format_ppl(389.456) == "389.46" and format_ppl(float("-inf")) == "-inf"


def test_prune_study_writes_ppl_against_n(tmp_path):
    model, calibration, tok = _setup()
    points = prune_study(model, tok, calibration, IDS, strategy="small_moe", values=[3, 6, 1], **PPL)
    assert points.strategy.tolist() == ["base", "small_moe", "small_moe", "small_moe"]
    assert points.status.tolist()[:3] == ["ok", "ok", "ok"] and points.status.iloc[3].startswith("error:")
    assert points.ppl.iloc[2] == ppl_point(prune_experts(model, calibration, keep=6), tok, IDS, **PPL)["ppl"]
    files = write_prune_study(points, tmp_path)
    assert files["plot"].is_file() and len(pd.read_csv(files["csv"])) == 4


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["task=compress", "model=tiny_qwen3_moe", f"paths.output_dir={tmp_path}",
                                            *overrides])


@pytest.mark.parametrize("mode", ["single", "best_ppl", "grid", "prune"])
def test_task_compress(mode, tmp_path):
    from moe_lab.models import load_model
    from moe_lab.runs.compress import compress, eval_ids
    from moe_lab.tasks import TASKS

    assert "compress" in TASKS

    tiny, _ = load_model(_cfg(tmp_path).model)
    cal = calibrate(tiny.eval(), [random_batch(batch=2, seq=16, pad_rows=())])
    cal.save(tmp_path / "cal.safetensors")
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 8)
    common = [f"compress.calibration_file={tmp_path / 'cal.safetensors'}", f"compress.eval.path={tmp_path / 'text.txt'}",
              "compress.eval.max_length=64", "compress.eval.stride=64"]
    if mode == "single":
        cfg = _cfg(tmp_path, *common, "compress.score=acp", "compress.grouping=wc", "compress.K=4")
        summary = compress(cfg)
        assert summary["status"] == "ok" and (tmp_path / "export" / "config.json").is_file()
        assert summary["manifest"]["grouping"] == "wc" and summary["manifest"]["K"] == 4
    elif mode == "best_ppl":  # the paper's Stage 2 scaling choice: independent conversions, lowest ppl
        cfg = _cfg(tmp_path, *common, "compress.score=sf", "compress.K=4", "compress.scaling=best_ppl")
        summary = compress(cfg)
        ids = eval_ids(cfg.compress.eval, load_tokenizer("byte"))
        found = {s: ppl_point(to_dense(tiny, cal, score="sf", grouping="rr", scaling=s, K=4), load_tokenizer("byte"),
                              ids, max_length=64, stride=64)["ppl"] for s in ("uniform", "proportional")}
        assert found["uniform"] != found["proportional"]
        assert summary["scaling_choice"]["chosen"] == min(found, key=found.get) == summary["manifest"]["scaling"]
        assert {s: v["ppl"] for s, v in summary["scaling_choice"]["candidates"].items()} == found
        assert summary["ppl"] == min(found.values())
    elif mode == "grid":
        cfg = _cfg(tmp_path, *common, "compress=paper_grid", "compress.grid.scores=[sf,cp]",
                   "compress.grid.groupings=[rr,rc]")
        summary = compress(cfg)
        assert summary["points"] == 2 * 2 * 2 * 3  # K = 2, 4, 8 (k, 2k, E)
        assert set(summary["best_per_pair"]) == {"sf/rr", "sf/rc", "cp/rr", "cp/rc"}
        points = pd.read_csv(tmp_path / "points.csv")
        for pair, choice in summary["best_per_pair"].items():  # the lowest ppl over (K, scaling) of the pair
            score, grouping = pair.split("/")
            rows = points[(points.score == score) & (points.grouping == grouping)]
            best = rows.loc[rows.ppl.idxmin()]
            assert (choice["K"], choice["scaling"], choice["ppl"]) == (best.K, best.scaling, best.ppl)
        assert (tmp_path / "grid.md").read_text().count("\n") == 2 + 8
    else:
        cfg = _cfg(tmp_path, *common, "compress=prune", "compress.prune.strategy=small_dense",
                   "compress.prune.n_keep=4")
        summary = compress(cfg)
        config = transformers.AutoConfig.from_pretrained(tmp_path / "export")
        assert config.num_experts == 4 and config.num_experts_per_tok == 4
        assert summary["manifest"]["keep"] == 4
