"""PNG plots of routing load and training curves.

Figures are drawn on matplotlib's Agg canvas directly (``matplotlib.figure.Figure``), never through
``pyplot``: no global backend switch, no figure registry to leak, safe inside training processes.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["expert_load_heatmap", "loss_curve", "read_metric_csv"]


def _save(fig: Figure, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    # Write next to the target and rename, so a reader (e.g. the W&B uploader) never sees half a PNG.
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=fig.dpi)
    os.replace(tmp, path)
    return path


def expert_load_heatmap(
    fractions,
    layer_indices: Sequence[int] | None,
    path: str | os.PathLike,
    title: str | None = None,
    vmax: float | None = None,
) -> Path:
    """Save a layer x expert heatmap of per-expert load fractions ``[L, E]`` as a PNG; returns the path.

    Rows are MoE layers (labelled with their decoder-layer ``layer_indices``), columns experts; colour is
    the share of the layer's routed (token, slot) assignments, on a scale from 0 to ``vmax`` (None: this
    heatmap's largest share; pass one value, e.g. ``1 / top_k``, to compare snapshots). The colorbar
    marks the uniform share ``1 / E``.
    """
    data = np.asarray(getattr(fractions, "cpu", lambda: fractions)(), dtype=np.float64)
    if data.ndim == 1:
        data = data[None, :]
    if data.ndim != 2 or data.size == 0:
        raise ValueError(f"expected fractions of shape [L, E], got {data.shape}")
    n_layers, n_experts = data.shape
    if layer_indices is None:
        layer_indices = list(range(n_layers))
    layer_indices = list(layer_indices)
    if len(layer_indices) != n_layers:
        raise ValueError(f"{len(layer_indices)} layer indices for {n_layers} rows of fractions")

    width = min(16.0, 3.0 + 0.25 * n_experts)
    height = min(14.0, 2.0 + 0.3 * n_layers)
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    finite = data[np.isfinite(data)]
    if vmax is None:
        vmax = max(float(finite.max()) if finite.size else 0.0, 1.0 / n_experts, 1e-12)
    image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=vmax)
    cbar = fig.colorbar(image, ax=ax)
    cbar.set_label("fraction of routed tokens")
    cbar.ax.axhline(1.0 / n_experts, color="white", linewidth=1.0, linestyle="--")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(n_layers), [str(i) for i in layer_indices])
    if n_experts <= 32:
        ax.set_xticks(range(n_experts))
    ax.set_title(title or "expert load")
    return _save(fig, path)


def _to_float(value) -> float | None:
    if value is None or value == "":
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def read_metric_csv(csv_path: str | os.PathLike, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` rows of one metric from a Lightning ``CSVLogger`` ``metrics.csv``.

    ``key`` may also be found as ``key + "_step"`` (metrics logged with both ``on_step`` and ``on_epoch``).
    Rows where the metric is empty are skipped.
    """
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        column = key if key in fields else f"{key}_step" if f"{key}_step" in fields else None
        if column is None:
            return []
        rows = []
        for row in reader:
            value, step = _to_float(row.get(column)), _to_float(row.get("step"))
            if value is not None and step is not None:
                rows.append((int(step), value))
    return rows


def loss_curve(
    source: str | os.PathLike | Iterable[tuple[int, float]],
    path: str | os.PathLike,
    title: str | None = None,
    keys: Sequence[str] = ("train/loss", "val/loss"),
    log_scale: bool = False,
) -> Path:
    """Save a PNG of loss vs step; returns the path.

    ``source`` is either a Lightning ``metrics.csv`` (every column of ``keys`` that has values is drawn;
    ``train/loss_step`` is accepted for ``train/loss``) or a list of ``(step, loss)`` pairs (drawn as
    ``keys[0]``). ``log_scale`` draws the loss axis logarithmically. Raises ``ValueError`` when there is
    nothing to draw.
    """
    if isinstance(source, (str, os.PathLike)):
        series = {key: read_metric_csv(source, key) for key in keys}
    else:
        series = {keys[0] if keys else "loss": [(int(s), float(v)) for s, v in source]}
    series = {key: sorted(rows) for key, rows in series.items() if rows}
    if not series:
        raise ValueError(f"no values for {list(keys)} in {source!r}")

    fig = Figure(figsize=(7.0, 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for key, rows in series.items():
        steps, values = zip(*rows)
        ax.plot(steps, values, marker="." if len(rows) < 50 else None, linewidth=1.2, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (log scale)" if log_scale else "loss")
    if log_scale:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title or "loss")
    return _save(fig, path)
