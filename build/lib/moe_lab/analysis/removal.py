"""Expert-removal study (Condenser paper Tables 5-8, spec 4.2-4.4): the paper's accuracy table layout, the
accuracy vs retained-parameters plot, and logistic / power-law fits (our addition, labelled as such)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .report import save_figure

STRATEGY_LABELS = {"small_dense": "Small Dense", "small_moe": "Small MoE", "inference_reduce": "Inference Reduce"}
SCORE_LABELS = {"es_act": "ES-Act", "es_mag": "ES-Mag"}


def logistic(log_n, a, c, b, log_n0):
    """acc = c + (a - c) / (1 + exp(-b (ln N - ln N0)))."""
    return c + (a - c) / (1 + np.exp(-b * (log_n - log_n0)))


def power_law(n, a, b, gamma):
    """acc = a - b N^-gamma (N in units of the base model's parameters)."""
    return a - b * np.power(n, -gamma)


def _r2(y, pred) -> float:
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return 1 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else math.nan


def fit(n: np.ndarray, acc: np.ndarray, base_n: float, base_acc: float) -> list[dict]:
    """Least-squares logistic (in ln N) and power-law fits: parameters, R^2 and N reaching 90% of base accuracy."""
    import warnings

    from scipy.optimize import OptimizeWarning, curve_fit

    warnings.simplefilter("ignore", OptimizeWarning)

    n, acc = np.asarray(n, float), np.asarray(acc, float)
    target = 0.9 * base_acc
    out = []
    if len(n) < 4:
        return [{"form": form, "status": f"needs >= 4 points, has {len(n)}"} for form in ("logistic", "power_law")]
    if np.ptp(acc) == 0:
        return [{"form": form, "status": "accuracy constant: nothing to fit"} for form in ("logistic", "power_law")]
    x = np.log(n)
    try:
        p, _ = curve_fit(logistic, x, acc, p0=[acc.max(), acc.min(), 2.0, float(np.median(x))], maxfev=20000)
        a, c, b, x0 = p
        n90 = math.exp(x0 - math.log((a - c) / (target - c) - 1) / b) if min(a, c) < target < max(a, c) else math.nan
        out.append({"form": "logistic", "params": {"a": a, "c": c, "b": b, "N0": math.exp(x0)},
                    "r2": _r2(acc, logistic(x, *p)), "n_at_90pct_base": n90, "status": "ok"})
    except (RuntimeError, ValueError) as err:
        out.append({"form": "logistic", "status": f"fit failed: {err}"})
    rel = n / base_n
    try:
        p, _ = curve_fit(power_law, rel, acc, p0=[acc.max(), max(acc.max() - acc.min(), 1e-3), 1.0], maxfev=20000)
        a, b, g = p
        n90 = base_n * ((a - target) / b) ** (-1 / g) if a > target and b > 0 and g != 0 else math.nan
        out.append({"form": "power_law", "params": {"a": a, "b": b, "gamma": g, "N_unit": base_n},
                    "r2": _r2(acc, power_law(rel, *p)), "n_at_90pct_base": n90, "status": "ok"})
    except (RuntimeError, ValueError) as err:
        out.append({"form": "power_law", "status": f"fit failed: {err}"})
    return out


def paper_table(points: pd.DataFrame) -> pd.DataFrame:
    """Rows (strategy, n', k'), one mean-accuracy column per score (the paper's Tables 7-8 layout), base first."""
    df = points.copy()
    scores = [s for s in df["score"].dropna().unique()] or ["es_act"]
    # score-free rows (base, Inference Reduce) belong in every score column, as the paper prints them
    free = df[df["score"].isna()]
    df = pd.concat([df[df["score"].notna()], *[free.assign(score=s) for s in scores]])
    table = df.pivot_table(index=["strategy", "n", "k"], columns="score", values="mean", aggfunc="first")
    order = {"base": 0, "small_dense": 1, "inference_reduce": 2, "small_moe": 3}
    table = table.reset_index()
    table["_o"] = table["strategy"].map(order)
    table = table.sort_values(["_o", "n", "k"], ascending=[True, False, False]).drop(columns="_o")
    return table.rename(columns={s: SCORE_LABELS.get(s, s) for s in table.columns})


def _scale(values) -> tuple[float, str]:
    top = float(np.nanmax(values))
    return next(((v, u) for v, u in ((1e9, "billions"), (1e6, "millions"), (1e3, "thousands")) if top >= v),
                (1.0, "count"))


def figure(points: pd.DataFrame, fits: dict, path, title: str):
    """Accuracy vs retained total parameters (log x; Small Dense / Small MoE per score; logistic and power-law
    fits of the first score's series, our addition) and vs active parameters (Inference Reduce, with the base
    model's k); base accuracy as a line in both."""
    from matplotlib.ticker import FuncFormatter

    base = points[points.strategy == "base"].iloc[0]
    unit, unit_name = _scale(points.params_total)
    fig = Figure(figsize=(12, 4.8), dpi=150, layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=[1.6, 1])
    colours = {"small_dense": "#4C72B0", "small_moe": "#DD8452", "inference_reduce": "#55A868"}
    markers = {"es_act": "o", "es_mag": "s"}
    pruned = points[points.strategy.isin(["small_dense", "small_moe"])]
    first_score = pruned.score.dropna().iloc[0] if len(pruned) else None
    for (strategy, score), grp in pruned.groupby(["strategy", "score"]):
        grp = grp.sort_values("params_total")
        x = grp.params_total / unit
        ax.plot(x, grp["mean"], marker=markers.get(score, "o"), color=colours[strategy],
                linestyle="-" if score == first_score else ":", markersize=5,
                label=f"{STRATEGY_LABELS[strategy]} ({SCORE_LABELS.get(score, score)})")
        if score != first_score:
            continue
        grid = np.geomspace(grp.params_total.min(), grp.params_total.max(), 200)
        for form, style in (("logistic", "--"), ("power_law", "-.")):
            f = next((v for v in fits.get(f"{strategy}/{score}", []) if v["form"] == form and v["status"] == "ok"),
                     None)
            if f is None:
                continue
            p = f["params"]
            y = logistic(np.log(grid), p["a"], p["c"], p["b"], math.log(p["N0"])) if form == "logistic" else \
                power_law(grid / p["N_unit"], p["a"], p["b"], p["gamma"])
            ax.plot(grid / unit, y, linestyle=style, color=colours[strategy], alpha=0.5, linewidth=1,
                    label=f"   {form.replace('_', '-')} fit, R²={f['r2']:.3f}")
    for axis in (ax, bx):
        axis.axhline(base["mean"], color="black", linestyle="--", linewidth=0.9,
                     label=f"base (n={int(base.n)}, k={int(base.k)}): {base['mean']:.1f}")
        axis.set_ylabel("mean accuracy (%)")
        axis.spines[["top", "right"]].set_visible(False)
    top = max(float(points["mean"].max()), 1.0)
    ax.set_ylim(0, top * 1.12)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "2468" else ""))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel(f"parameters retained (total, {unit_name})")
    ax.set_title("Expert removal: accuracy vs retained parameters (fits: our addition)", fontsize=10)
    ax.legend(frameon=False, fontsize=7, loc="lower right")
    ir = pd.concat([points[points.strategy == "inference_reduce"], points[points.strategy == "base"]])
    if len(ir) > 1:
        ir = ir.sort_values("params_active")
        a_unit, a_name = _scale(ir.params_active)
        bx.plot(ir.params_active / a_unit, ir["mean"], marker="^", color=colours["inference_reduce"],
                label="Inference Reduce (all experts kept)")
        for _, r in ir.iterrows():
            bx.annotate(f"k'={int(r.k)}", (r.params_active / a_unit, r["mean"]), textcoords="offset points",
                        xytext=(5, -10), fontsize=7)
        bx.set_xlabel(f"active parameters per token ({a_name})")
    bx.set_ylim(0, top * 1.12)
    bx.set_title("Inference Reduce: accuracy vs active parameters", fontsize=10)
    bx.legend(frameon=False, fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path)
