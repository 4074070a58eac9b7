"""The MoE -> dense paper's diagnostics from one calibration file (docs/specs/compression.md 2.3, 2.12 items 2-4).

- :func:`selection_overlap` (Fig. 2): |S_a ∩ S_b| / K between the K experts two scores select, averaged over MoE
  layers (``measure="jaccard"``: |S_a ∩ S_b| / |S_a ∪ S_b|).
- :func:`effective_ranks` (Fig. 3): the Roy-Vetterli effective rank of the selected experts' kernel submatrix
  K_S = sqrt(I_i I_j) gram_ij / n, with the method's own base importance I (CP for cp / do_cp, ACP for acp /
  do_acp; lambda not added), averaged over MoE layers, for every K.
- :func:`marginal_means` (Fig. 4): the post-distillation mean accuracy averaged over groupings per score and over
  scores per grouping, from a results table (:func:`read_results`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from ..core.atomic import atomic_write
from .calibration import Calibration
from .dopt import effective_rank
from .scores import DOPT_METHODS, dopt_kernel, select_experts
from .scores import scores as expert_scores

MEASURES = ("overlap", "jaccard")
RANK_PAIRS = (("cp", "do_cp"), ("acp", "do_acp"))
BASE_IMPORTANCE = {"cp": "cp", "do_cp": "cp", "acp": "acp", "do_acp": "acp"}  # the kernel of each method
LABELS = {"sf": "SF", "pp": "PP", "ps": "PS", "cp": "CP", "acp": "ACP", "do_cp": "DO-CP", "do_acp": "DO-ACP",
          "rr": "RR", "wc": "WC", "rc": "RC", "ab": "AB", "oc": "OC"}


def selection_overlap(calibration: Calibration, scores: Sequence[str], K: int, measure: str = "overlap",
                      lam="auto", seed: int = 0) -> pd.DataFrame:
    """[scores x scores] mean over MoE layers of |S_a ∩ S_b| / K (or the Jaccard index) of the K selected experts."""
    if measure not in MEASURES:
        raise ValueError(f"task.overlap_measure={measure!r}: choose one of {', '.join(MEASURES)}")
    sets = {s: {layer: set(e.tolist()) for layer, e in select_experts(calibration, s, K, lam=lam, seed=seed).items()}
            for s in scores}
    layers = list(calibration.layers)
    table = pd.DataFrame(index=list(scores), columns=list(scores), dtype=float)
    for a in scores:
        for b in scores:
            values = []
            for layer in layers:
                sa, sb = sets[a][layer], sets[b][layer]
                values.append(len(sa & sb) / (int(K) if measure == "overlap" else len(sa | sb)))
            table.loc[a, b] = sum(values) / len(values)
    return table


def layer_effective_rank(calibration: Calibration, layer: int, importance: torch.Tensor, chosen) -> float:
    """Effective rank of the kernel submatrix on ``chosen`` of one layer; NaN where the submatrix is zero."""
    kernel = dopt_kernel(calibration.layers[layer], importance)
    idx = torch.as_tensor(list(chosen), dtype=torch.long)
    try:
        return effective_rank(kernel[idx][:, idx])
    except ValueError:
        return math.nan


def effective_ranks(calibration: Calibration, Ks: Sequence[int], methods: Sequence[str] | None = None,
                    lam="auto") -> pd.DataFrame:
    """One row per (method, K): ``erank`` (mean over MoE layers with a defined rank), ``layers`` counted and ``K``
    (the maximum). ``methods`` default: cp, do_cp, acp, do_acp."""
    methods = list(methods) if methods is not None else [m for pair in RANK_PAIRS for m in pair]
    for m in methods:
        if m not in BASE_IMPORTANCE:
            raise ValueError(f"effective rank of {m!r}: the paper's kernel is defined for {', '.join(BASE_IMPORTANCE)}")
    rows = []
    for m in methods:
        importance = expert_scores(calibration, BASE_IMPORTANCE[m])
        for K in Ks:
            chosen = select_experts(calibration, m, int(K), lam=lam)
            ranks = [layer_effective_rank(calibration, layer, importance[layer], chosen[layer].tolist())
                     for layer in calibration.layers]
            finite = [r for r in ranks if math.isfinite(r)]
            rows.append({"method": m, "K": int(K), "erank": sum(finite) / len(finite) if finite else math.nan,
                         "layers": len(finite), "dopt": m in DOPT_METHODS})
    return pd.DataFrame(rows)


def read_results(path) -> pd.DataFrame:
    """A (score, grouping, value) table from a CSV with those columns, or from a ``reported.csv``
    (experiments/moe_to_dense: its Table 12 ``Avg.`` cells, score and grouping read from ``eval``)."""
    frame = pd.read_csv(path)
    if {"score", "grouping", "value"} <= set(frame.columns):
        return frame[["score", "grouping", "value"]].astype({"value": float})
    if {"table", "eval", "benchmark", "value"} <= set(frame.columns):
        cells = frame[(frame.table == "Table 12") & (frame.benchmark == "Avg.")]
        knobs = cells["eval"].map(lambda e: dict(p.split("=", 1) for p in str(e).split(";") if "=" in p))
        return pd.DataFrame({"score": knobs.map(lambda k: k.get("score")),
                             "grouping": knobs.map(lambda k: k.get("grouping")),
                             "value": cells["value"].astype(float)}).reset_index(drop=True)
    raise ValueError(f"task.results={path}: needs columns score, grouping, value (one distilled run per row) or a "
                     "reported.csv (table, eval, benchmark, value)")


def marginal_means(results: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(mean value per score over its groupings, mean per grouping over its scores), in first-seen order."""
    if results.duplicated(["score", "grouping"]).any():
        raise ValueError("the results table holds a (score, grouping) pair twice: keep one run per pair")
    by_score = results.groupby("score", sort=False)["value"].mean()
    by_grouping = results.groupby("grouping", sort=False)["value"].mean()
    return by_score, by_grouping


def write_table(frame: pd.DataFrame, path, index: bool = False) -> Path:
    """``frame`` as CSV, written atomically."""
    return atomic_write(path, lambda tmp: frame.to_csv(tmp, index=index))
