"""One-process compression sweeps from one calibration file (docs/specs/compression.md 2.11-2.12, 4.2-4.4).

:func:`dense_sweep` evaluates every score x grouping x scaling x K point on ONE loaded teacher: one dense
student skeleton is built once and only its FFNs are rewritten per point (``DenseBuilder.write``); scores and
selections are computed once per (score, K). A point that fails (NaN/inf perplexity, a numerical error in
selection or conversion) is recorded with its reason, never fatal. :func:`write_grid` writes the
pre-distillation perplexity grid in the paper's layout (rows score x grouping x scaling, columns K, row
minimum marked) as CSV, Markdown and a heatmap PNG. :func:`prune_study` / :func:`write_prune_study` do the
same for Small Dense / Small MoE / Inference Reduce against n' or k'.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pandas as pd
from torch import nn

from ..compress.calibration import Calibration
from ..compress.dense import DenseBuilder, check_choice, check_K, plan
from ..compress.grouping import GROUPINGS
from ..compress.merge import SCALINGS, check_scaling
from ..compress.prune import prune_experts, strategy_counts
from ..compress.scores import METHODS, select_experts
from ..compress.scores import scores as expert_scores
from ..core.atomic import atomic_write, atomic_write_text
from ..eval.perplexity import perplexity
from ..moe.view import find_moe_layers

log = logging.getLogger(__name__)
PAPER_SCORES = ("sf", "pp", "ps", "cp", "acp", "do_cp", "do_acp")
BEST_PPL = "best_ppl"  # compress.scaling: choose among compress.scaling_candidates by pre-distillation ppl


def ppl_point(model: nn.Module, tokenizer, ids: Sequence[int], max_length: int, stride: int,
              batch_size: int = 8) -> dict:
    """Perplexity of ``model`` on token ids, as a record; overflow / NaN / errors become a failed record."""
    try:
        result = perplexity(model, tokenizer, list(ids), max_length=max_length, stride=stride,
                            batch_size=batch_size)
        ppl, nll = float(result["ppl"]), float(result["nll"])
    except OverflowError:  # math.exp of a huge nll
        return {"ppl": math.inf, "nll": math.inf, "status": "inf"}
    except (RuntimeError, ValueError, ArithmeticError) as err:
        return {"ppl": math.nan, "nll": math.nan, "status": f"error: {err}"}
    status = "ok" if math.isfinite(ppl) else ("nan" if math.isnan(ppl) else "inf")
    return {"ppl": ppl, "nll": nll, "status": status}


def dense_sweep(model: nn.Module, tokenizer, calibration: Calibration, ids: Sequence[int], *,
                scores: Sequence[str] = PAPER_SCORES, groupings: Sequence[str] = GROUPINGS,
                scalings: Sequence[str] = ("uniform", "proportional"), Ks: Sequence[int] | None = None,
                order: str = "score", lam="auto", seed: int = 0, max_length: int = 2048, stride: int = 2048,
                batch_size: int = 8, progress: Callable[[dict], None] | None = None,
                done: Mapping[tuple, dict] | None = None, stop: Callable[[], bool] | None = None) -> pd.DataFrame:
    """Pre-distillation perplexity of every (score, grouping, scaling, K) student of ``model``; one row per
    point (``ppl``, ``nll``, ``status``, ``seconds``). ``Ks`` default: k, 2k, 4k, ... up to E. ``done``: rows
    already measured, by ``(score, grouping, scaling, str(K))``, reused as they are; ``stop()`` true after a point
    ends the sweep there (the rows so far are returned). ``progress(point)`` for every newly measured point."""
    done = done or {}
    calibration.check_compatible(model)
    builder = DenseBuilder(model)
    view = builder.views[0]
    k, E = view.top_k, view.num_experts
    Ks = list(Ks) if Ks is not None else _powers(k, E)
    for K in Ks:
        check_K(K, k, E)
    for s in scores:
        check_choice("score", s, METHODS)
    for g in groupings:
        check_choice("grouping", g, GROUPINGS)
    for s in scalings:
        check_choice("scaling", s, SCALINGS)
        check_scaling(s, view.rule.normalises_topk, view.rule.scaling)
    if view.rule.scaling != 1.0:
        log.info("routed_scaling_factor=%g: uniform / proportional alphas sum to it (the routed mass)",
                 view.rule.scaling)
    rows, distances = [], {}
    def key(score, grouping, scaling, K) -> tuple:
        return (score, grouping, scaling, str(int(K)))

    for score in scores:
        score_values = None
        for K in Ks:
            selected = False  # the selection of (score, K), made once its first unfinished point needs it
            for grouping, scaling in [(g, s) for g in groupings for s in scalings]:
                if key(score, grouping, scaling, K) in done:
                    rows.append(done[key(score, grouping, scaling, K)])
                    continue
                if score_values is None:
                    score_values = expert_scores(calibration, score, seed=seed)
                if not selected:
                    selected = True
                    try:
                        selection, failed = select_experts(calibration, score, K, lam=lam, seed=seed), None
                    except (ValueError, RuntimeError, ArithmeticError) as err:
                        selection, failed = None, f"error: {err}"
                start = time.perf_counter()
                point = {"score": score, "grouping": grouping, "scaling": scaling, "K": int(K)}
                if failed is None:
                    try:
                        plans = plan(model, calibration, score=score, grouping=grouping, scaling=scaling,
                                     K=K, order=order, lam=lam, seed=seed, selection=selection,
                                     score_values=score_values, distances=distances)
                        builder.write(plans)
                        point.update(ppl_point(builder.student, tokenizer, ids, max_length, stride, batch_size))
                    except (ValueError, RuntimeError, ArithmeticError) as err:
                        point.update({"ppl": math.nan, "nll": math.nan, "status": f"error: {err}"})
                else:
                    point.update({"ppl": math.nan, "nll": math.nan, "status": failed})
                point["seconds"] = time.perf_counter() - start
                rows.append(point)
                if progress is not None:
                    progress(point)
                if stop is not None and stop():
                    return pd.DataFrame(rows)
    return pd.DataFrame(rows)


def choose_scaling(model: nn.Module, tokenizer, calibration: Calibration, ids: Sequence[int], *, score: str,
                   grouping: str, K: int | None, candidates: Sequence[str] = ("uniform", "proportional"),
                   **kw) -> tuple[str, dict[str, dict]]:
    """The paper's Stage 2 for one (score, grouping, K): the scaling among ``candidates`` whose student has the
    lowest pre-distillation perplexity on ``ids`` (ties: the first candidate). Returns ``(chosen, {scaling:
    {ppl, status}})``; refuses when no candidate gives a finite perplexity. ``kw``: :func:`dense_sweep`'s."""
    if not candidates:
        raise ValueError("compress.scaling=best_ppl needs compress.scaling_candidates (e.g. [uniform, proportional])")
    Ks = None if K is None else [int(K)]
    if Ks is None:
        Ks = [find_moe_layers(model)[0].top_k]
    points = dense_sweep(model, tokenizer, calibration, ids, scores=[score], groupings=[grouping],
                         scalings=list(candidates), Ks=Ks, **kw)
    found = {row.scaling: {"ppl": float(row.ppl), "status": row.status} for row in points.itertuples()}
    finite = [s for s in candidates if math.isfinite(found[s]["ppl"])]
    if not finite:
        raise ValueError(f"compress.scaling=best_ppl: no candidate scaling gives a finite perplexity ({found})")
    chosen = min(finite, key=lambda s: found[s]["ppl"])
    log.info("compress.scaling=best_ppl chose %s (%s)", chosen,
             ", ".join(f"{s} {found[s]['ppl']:.4g}" for s in candidates))
    return chosen, found


def _powers(k: int, E: int) -> list[int]:
    out, K = [], k
    while K < E:
        out.append(K)
        K *= 2
    return out + [E]


# --------------------------------------------------------------------------------------------------------
# The paper-layout grid


def grid_table(points: pd.DataFrame) -> pd.DataFrame:
    """Rows (score, grouping, scaling) in sweep order, columns K (ppl, NaN/inf kept), plus ``best_K`` and
    ``best_ppl`` (the row minimum over finite cells; empty when none is finite)."""
    keys = ["score", "grouping", "scaling"]
    rows = list(dict.fromkeys(points[keys].itertuples(index=False, name=None)))
    table = points.set_index(keys + ["K"])["ppl"].unstack("K")
    table = table.reindex(pd.MultiIndex.from_tuples(rows, names=keys))[sorted(set(points["K"]))]
    finite = table.where(table.apply(lambda c: c.map(math.isfinite)))
    has = finite.notna().any(axis=1)
    table["best_K"] = finite[has].idxmin(axis=1).reindex(table.index).astype("Int64")
    table["best_ppl"] = finite.min(axis=1)
    return table


def format_ppl(value: float) -> str:
    """Paper-style cell: 2 decimals below 1,000, thousands separators below 10^6, else 3 significant digits;
    ``nan`` / ``inf`` as such."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value < 1000:
        return f"{value:.2f}"
    if value < 1e6:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def grid_markdown(table: pd.DataFrame) -> str:
    """The grid as a Markdown table, the row minimum in bold."""
    Ks = [c for c in table.columns if c not in ("best_K", "best_ppl")]
    lines = ["| score | grouping | scaling | " + " | ".join(f"K={K}" for K in Ks) + " |",
             "|---|---|---|" + "---|" * len(Ks)]
    for (score, grouping, scaling), row in table.iterrows():
        cells = []
        for K in Ks:
            text = format_ppl(float(row[K]))
            cells.append(f"**{text}**" if not pd.isna(row["best_K"]) and int(row["best_K"]) == K else text)
        lines.append(f"| {score} | {grouping} | {scaling} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def grid_heatmap(table: pd.DataFrame, path, title: str = "pre-distillation perplexity") -> Path:
    """Heatmap of log10(ppl): one row per (score, grouping, scaling), one column per K, each cell annotated,
    the row minimum boxed; NaN/inf cells grey and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    Ks = [c for c in table.columns if c not in ("best_K", "best_ppl")]
    values = table[Ks].to_numpy(dtype=float)
    finite = np.isfinite(values)
    logv = np.where(finite, np.log10(np.where(finite & (values > 0), values, 1.0)), np.nan)
    n_rows = len(table)
    fig, ax = plt.subplots(figsize=(2.2 + 1.1 * len(Ks), 1.2 + 0.26 * n_rows))
    cmap = matplotlib.colormaps["viridis_r"].with_extremes(bad="#bbbbbb")
    image = ax.imshow(np.ma.masked_invalid(logv), aspect="auto", cmap=cmap, interpolation="nearest")
    lo, hi = (np.nanmin(logv), np.nanmax(logv)) if np.isfinite(logv).any() else (0.0, 1.0)
    for r in range(n_rows):
        best = table["best_K"].iloc[r]
        for c, K in enumerate(Ks):
            v = values[r, c]
            dark = finite[r, c] and hi > lo and (logv[r, c] - lo) / (hi - lo) > 0.6
            is_best = not pd.isna(best) and int(best) == K
            ax.text(c, r, format_ppl(v), ha="center", va="center", fontsize=7,
                    color="white" if dark else "black", fontweight="bold" if is_best else "normal")
            if is_best:
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    ax.set_xticks(range(len(Ks)), [f"K={K}" for K in Ks])
    ax.xaxis.tick_top()
    ax.set_yticks(range(n_rows), [" / ".join(map(str, idx)) for idx in table.index], fontsize=7)
    ax.set_title(f"{title}\n(log colour scale; red box = row minimum; grey = NaN/inf)", fontsize=9, pad=18)
    bar = fig.colorbar(image, ax=ax, label="perplexity (log scale)", fraction=0.04, pad=0.02)
    bar.ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: format_ppl(10 ** v)))
    fig.tight_layout()
    path = atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=130, format="png"))
    plt.close(fig)
    return path


def write_grid(points: pd.DataFrame, directory, title: str = "pre-distillation perplexity") -> dict[str, Path]:
    """``points.csv`` (long), ``grid.csv`` / ``grid.md`` (paper layout) and ``grid.png`` in ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    table = grid_table(points)
    out = {"points": directory / "points.csv", "grid_csv": directory / "grid.csv",
           "grid_md": directory / "grid.md", "heatmap": directory / "grid.png"}
    atomic_write(out["points"], lambda tmp: points.to_csv(tmp, index=False))
    atomic_write(out["grid_csv"], table.to_csv)
    atomic_write_text(out["grid_md"], grid_markdown(table))
    grid_heatmap(table, out["heatmap"], title)
    return out


# --------------------------------------------------------------------------------------------------------
# Pruning studies


def prune_study(model: nn.Module, tokenizer, calibration: Calibration | None, ids: Sequence[int], *,
                strategy: str, values: Sequence[int], score: str = "es_act", always_keep=None,
                group_balanced: bool = False, max_length: int = 2048, stride: int = 2048,
                batch_size: int = 8, progress: Callable[[dict], None] | None = None,
                done: Mapping[tuple, dict] | None = None, stop: Callable[[], bool] | None = None) -> pd.DataFrame:
    """Perplexity against n' (small_dense / small_moe) or k' (inference_reduce), plus the base model; one
    pruned model per value (they differ in shape). ``progress``, ``done`` (by ``(strategy, str(n_keep),
    str(top_k))``) and ``stop``: as :func:`dense_sweep`'s."""
    done = done or {}
    view_E, view_k = _counts(model)
    rows = []
    for value in [None, *values]:
        if value is None:
            row = {"strategy": "base", "n_keep": view_E, "top_k": view_k}
        else:
            n_keep, k_keep = strategy_counts(strategy, view_E, view_k, n_keep=value, k_keep=value)
            row = {"strategy": strategy, "n_keep": n_keep, "top_k": k_keep}
        key = (row["strategy"], str(row["n_keep"]), str(row["top_k"]))
        if key in done:
            rows.append(done[key])
            continue
        if value is None:
            row.update(params=_params(model), **ppl_point(model, tokenizer, ids, max_length, stride, batch_size))
        else:
            try:
                pruned = prune_experts(model, calibration, keep=n_keep, top_k=k_keep, score=score,
                                       always_keep=always_keep, group_balanced=group_balanced)
                row.update(params=_params(pruned),
                           **ppl_point(pruned, tokenizer, ids, max_length, stride, batch_size))
                del pruned
            except (ValueError, RuntimeError) as err:
                row.update(params=math.nan, ppl=math.nan, nll=math.nan, status=f"error: {err}")
        rows.append(row)
        if progress is not None:
            progress(row)
        if stop is not None and stop():
            break
    return pd.DataFrame(rows)


def _counts(model) -> tuple[int, int]:
    view = find_moe_layers(model)[0]
    return view.num_experts, view.top_k


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def write_prune_study(points: pd.DataFrame, directory) -> dict[str, Path]:
    """``prune.csv`` and ``prune.png``: perplexity (log scale) against n' or k', the base model as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {"csv": directory / "prune.csv", "plot": directory / "prune.png"}
    atomic_write(out["csv"], lambda tmp: points.to_csv(tmp, index=False))
    base = points[points.strategy == "base"].iloc[0]
    study = points[points.strategy != "base"]
    fig, ax = plt.subplots(figsize=(6, 4))
    if len(study):
        strategy = study.strategy.iloc[0]
        axis = "top_k" if strategy == "inference_reduce" else "n_keep"
        ok = study[study.ppl.map(lambda v: math.isfinite(v))]
        ax.plot(ok[axis], ok.ppl, marker="o", label=strategy)
        for _, row in study[~study.index.isin(ok.index)].iterrows():
            ax.annotate(row.status.split(":")[0], (row[axis], base.ppl), fontsize=7, color="red")
        ax.set_xlabel("k' (active experts)" if axis == "top_k" else "n' (experts kept per layer)")
    ax.axhline(base.ppl, color="gray", linestyle="--", label=f"base (n={base.n_keep}, k={base.top_k})")
    ax.set_yscale("log")
    ax.set_ylabel("perplexity")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(out["plot"], lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return out
