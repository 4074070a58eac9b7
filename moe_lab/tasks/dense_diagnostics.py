"""task=dense_diagnostics: the MoE -> dense paper's Figs. 2-4 from one calibration file (and, for Fig. 4, a
results table): selection_overlap.{csv,png}, effective_rank.{csv,png}, marginal_means_{score,grouping}.csv +
marginal_means.png, summary.json (see ``moe_lab.compress.diagnostics``)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from omegaconf import DictConfig

from ..analysis.report import save_figure
from ..compress.calibration import Calibration
from ..compress.diagnostics import (
    LABELS,
    RANK_PAIRS,
    effective_ranks,
    marginal_means,
    read_results,
    selection_overlap,
    write_table,
)
from ..core.atomic import atomic_write_json

log = logging.getLogger(__name__)


def _label(name: str) -> str:
    return LABELS.get(name, name)


def overlap_figure(table: pd.DataFrame, K: int, measure: str, path: Path, title: str) -> Path:
    """Annotated heatmap of the overlap matrix (Fig. 2)."""
    n = len(table)
    fig = Figure(figsize=(1.0 + 0.75 * n, 0.8 + 0.7 * n), dpi=130, layout="constrained")
    ax = fig.add_subplot()
    values = table.to_numpy(dtype=float)
    image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="Blues")
    for r in range(n):
        for c in range(n):
            ax.text(c, r, f"{values[r, c]:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if values[r, c] > 0.6 else "black")
    labels = [_label(s) for s in table.index]
    ax.set_xticks(range(n), labels, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(n), labels, fontsize=8)
    what = "|S_a ∩ S_b| / K" if measure == "overlap" else "|S_a ∩ S_b| / |S_a ∪ S_b|"
    ax.set_title(f"{title}\nselection overlap of the top-K={K} experts ({what}), mean over layers", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return save_figure(fig, path)


def rank_figure(ranks: pd.DataFrame, path: Path, title: str) -> Path:
    """Layer-mean effective rank against K (Fig. 3): independent scores dashed, their D-optimal versions solid,
    the maximum (K) dotted."""
    fig = Figure(figsize=(6.0, 4.2), dpi=130, layout="constrained")
    ax = fig.add_subplot()
    colours = {"cp": "tab:blue", "do_cp": "tab:blue", "acp": "tab:orange", "do_acp": "tab:orange"}
    for method, rows in ranks.groupby("method", sort=False):
        ax.plot(rows.K, rows.erank, marker="o", color=colours.get(method), label=_label(method),
                linestyle="-" if rows.dopt.iloc[0] else "--")
    Ks = sorted(set(ranks.K))
    ax.plot(Ks, Ks, color="gray", linestyle=":", label="maximum (K)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ks, [str(k) for k in Ks])
    ax.set_xlabel("K (selected experts)")
    ax.set_ylabel("effective rank of K_S (mean over layers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{title}\ndiversity of the selected experts (Roy-Vetterli effective rank)", fontsize=9)
    return save_figure(fig, path)


def marginal_figure(by_score: pd.Series, by_grouping: pd.Series, path: Path, title: str) -> Path:
    """Two bar panels (Fig. 4): mean accuracy per score, per grouping, the value on each bar."""
    fig = Figure(figsize=(9.0, 3.6), dpi=130, layout="constrained")
    axes = fig.subplots(1, 2, gridspec_kw={"width_ratios": [len(by_score), len(by_grouping)]})
    for ax, series, what in ((axes[0], by_score, "(a) scoring"), (axes[1], by_grouping, "(b) grouping")):
        x = np.arange(len(series))
        bars = ax.bar(x, series.to_numpy(), color="tab:blue" if what.startswith("(a)") else "tab:green")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(x, [_label(s) for s in series.index], fontsize=8)
        lo, hi = float(series.min()), float(series.max())
        ax.set_ylim(lo - max(1.0, 0.5 * (hi - lo)), hi + max(0.5, 0.15 * (hi - lo)))
        ax.set_title(what, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("mean accuracy (%)")
    fig.suptitle(f"{title}: marginal means", fontsize=10)
    return save_figure(fig, path)


def _Ks(t, k: int, E: int) -> list[int]:
    if t.get("rank_K"):
        return [int(K) for K in t.rank_K]
    out, K = [], k
    while K < E:
        out.append(K)
        K *= 2
    return out + [E]


def figure_title(model: str, calibration_file) -> str:
    """The figures' title: the model (a local folder by its name) and the calibration file's name, no folder path."""
    name = Path(str(calibration_file)).name
    if not model:
        return name
    return f"{Path(model).name if Path(model).is_absolute() else model} ({name})"


def dense_diagnostics_task(cfg: DictConfig) -> dict:
    t = cfg.task
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not t.get("calibration_file"):
        raise ValueError("task.calibration_file is not set: give a task=calibrate run's calibration.safetensors")
    cal = Calibration.load(t.calibration_file)
    k, E = int(cal.manifest["top_k"]), int(cal.manifest["num_experts"])
    K = int(t.overlap_K) if t.get("overlap_K") is not None else k
    title = figure_title(str(cal.manifest.get("model") or ""), t.calibration_file)
    lam = t.get("lam", "auto")
    files, summary = {}, {"calibration": str(t.calibration_file), "top_k": k, "num_experts": E}

    overlap = selection_overlap(cal, list(t.scores), K, t.overlap_measure, lam=lam)
    files["overlap_csv"] = write_table(overlap, out / "selection_overlap.csv", index=True)
    files["overlap_png"] = overlap_figure(overlap, K, t.overlap_measure, out / "selection_overlap.png", title)
    summary["overlap"] = {"K": K, "measure": t.overlap_measure, "matrix": overlap.round(6).to_dict()}

    ranks = effective_ranks(cal, _Ks(t, k, E), [m for pair in RANK_PAIRS for m in pair], lam=lam)
    files["rank_csv"] = write_table(ranks, out / "effective_rank.csv")
    files["rank_png"] = rank_figure(ranks, out / "effective_rank.png", title)
    summary["effective_rank"] = {f"{r.method}/K{r.K}": r.erank for r in ranks.itertuples()}

    if t.get("results"):
        by_score, by_grouping = marginal_means(read_results(t.results))
        files["marginal_score_csv"] = write_table(by_score.rename("mean").reset_index(),
                                                  out / "marginal_means_score.csv")
        files["marginal_grouping_csv"] = write_table(by_grouping.rename("mean").reset_index(),
                                                     out / "marginal_means_grouping.csv")
        files["marginal_png"] = marginal_figure(by_score, by_grouping, out / "marginal_means.png",
                                                Path(str(t.results)).name)
        summary["marginal_means"] = {"score": by_score.to_dict(), "grouping": by_grouping.to_dict()}
    else:
        log.info("task.results not set: the marginal means (Fig. 4) need one distilled result per (score, grouping)")
    summary["files"] = {key: str(path) for key, path in files.items()}
    atomic_write_json(out / "summary.json", summary, default=str)
    print(f"==== moe-lab dense_diagnostics: {len(files)} files in {out}", flush=True)
    return summary
