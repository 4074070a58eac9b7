"""Router-bias trajectories (Expert Condenser): a CSV to re-plot from and a per-layer line plot.

:class:`BiasTrajectory` holds every MoE layer's bias vector at a series of optimizer steps plus, per
layer, the condenser experts and the step at which they were chosen. ``to_csv``/``from_csv`` round-trip
it through a tidy CSV with one row per (step, layer, expert)::

    step,layer,expert,bias,condenser,chosen_at
    0,0,0,0.0,0,3
    ...

``bias`` is written with full float32 precision; ``condenser`` is 1 from the step the expert became a
condenser of its layer on; ``chosen_at`` is the step at which the layer's condensers were chosen (empty:
none chosen), also when that step precedes the first row (a resumed run). Re-plot one layer with pandas:
``df[df.layer == 0].pivot(index="step", columns="expert", values="bias").plot()``.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["BiasTrajectory", "bias_trajectory_plot"]

CSV_FIELDS = ("step", "layer", "expert", "bias", "condenser", "chosen_at")


@dataclass
class BiasTrajectory:
    """Biases ``biases[layer index]`` (float32 ``[len(steps), E]``) at optimizer ``steps``; condenser
    experts ``condensers[layer index]`` chosen at step ``chosen_at[layer index]`` (absent: none yet)."""

    steps: list[int]
    biases: dict[int, np.ndarray]
    condensers: dict[int, list[int]] = field(default_factory=dict)
    chosen_at: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        for index, values in self.biases.items():
            if values.ndim != 2 or values.shape[0] != len(self.steps):
                raise ValueError(
                    f"layer {index}: expected biases of shape [{len(self.steps)} steps, E], got {values.shape}"
                )

    @property
    def layers(self) -> list[int]:
        return sorted(self.biases)

    def is_condenser(self, layer: int, expert: int, step: int) -> bool:
        chosen = self.chosen_at.get(layer)
        return chosen is not None and step >= chosen and expert in self.condensers.get(layer, [])

    def to_csv(self, path: str | os.PathLike) -> Path:
        """Write the long-format CSV atomically; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(CSV_FIELDS)
            for row, step in enumerate(self.steps):
                for layer in self.layers:
                    chosen = self.chosen_at.get(layer, "")
                    for expert, value in enumerate(self.biases[layer][row].tolist()):
                        flag = int(self.is_condenser(layer, expert, step))
                        writer.writerow((step, layer, expert, repr(value), flag, chosen))
        os.replace(tmp, path)
        return path

    @classmethod
    def from_csv(cls, path: str | os.PathLike) -> BiasTrajectory:
        """Read a CSV written by :meth:`to_csv`."""
        values: dict[int, dict[int, dict[int, float]]] = {}  # layer -> step -> expert -> bias
        condensers: dict[int, set[int]] = {}
        chosen_at: dict[int, int] = {}
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = set(CSV_FIELDS) - set(reader.fieldnames or [])
            if missing:
                raise ValueError(f"{path}: not a router-bias trajectory CSV, missing columns {sorted(missing)}")
            for line, row in enumerate(reader, start=2):
                try:
                    step, layer, expert = int(row["step"]), int(row["layer"]), int(row["expert"])
                    bias, flag = float(row["bias"]), int(row["condenser"])
                    chosen = int(row["chosen_at"]) if row["chosen_at"] else None
                except ValueError as err:
                    raise ValueError(f"{path}, line {line}: {err}") from err
                values.setdefault(layer, {}).setdefault(step, {})[expert] = bias
                if chosen is not None:
                    chosen_at[layer] = chosen
                if flag:
                    condensers.setdefault(layer, set()).add(expert)
        steps = sorted({s for per_step in values.values() for s in per_step})
        biases = {
            layer: np.array([[per_step[s][e] for e in sorted(per_step[s])] for s in steps], dtype=np.float32)
            for layer, per_step in values.items()
        }
        return cls(
            steps=steps,
            biases=biases,
            condensers={layer: sorted(ids) for layer, ids in condensers.items()},
            chosen_at=chosen_at,
        )


def _thin(n: int, max_points: int) -> np.ndarray:
    """Row indices keeping at most ~``max_points`` evenly spaced rows, always the first and the last."""
    if n <= max_points:
        return np.arange(n)
    keep = np.unique(np.linspace(0, n - 1, max_points).round().astype(int))
    return keep


def _end_labels(last: np.ndarray, experts: list[int], values: np.ndarray) -> list[tuple[list[int], float]]:
    """``([expert ids], y)`` line-end labels, experts whose ends are within 3% of the y-range merged."""
    span = float(np.ptp(values)) or 1.0
    labels: list[tuple[list[int], list[float]]] = []
    for expert in sorted(experts, key=lambda e: float(last[e])):
        y = float(last[expert])
        if labels and y - labels[-1][1][-1] <= 0.03 * span:
            labels[-1][0].append(expert)
            labels[-1][1].append(y)
        else:
            labels.append(([expert], [y]))
    return [(sorted(ids), float(np.mean(ys))) for ids, ys in labels]


def bias_trajectory_plot(
    trajectory: BiasTrajectory,
    path: str | os.PathLike,
    title: str | None = None,
    max_points: int = 1000,
) -> Path:
    """Save a PNG with one panel per MoE layer: each expert's bias over optimizer steps (thin lines
    coloured by expert id), the condenser experts in bold red and labelled, and a dashed vertical line at
    the step they were chosen. At most ``max_points`` steps are drawn per line (evenly thinned)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    from .plots import _save

    layers = trajectory.layers
    if not layers or not trajectory.steps:
        raise ValueError("empty router-bias trajectory: nothing to plot")
    ncols = min(len(layers), 4)
    nrows = math.ceil(len(layers) / ncols)
    fig = Figure(
        figsize=(min(4.6 * ncols, 20.0), min(3.4 * nrows + 0.8, 40.0)), dpi=100, layout="constrained"
    )
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True)
    rows = _thin(len(trajectory.steps), max_points)
    steps = np.asarray(trajectory.steps)[rows]
    palette = colormaps["viridis"]
    for slot, layer in enumerate(layers):
        ax = axes[slot // ncols][slot % ncols]
        values = trajectory.biases[layer][rows]
        num_experts = values.shape[1]
        condensers = trajectory.condensers.get(layer, []) if layer in trajectory.chosen_at else []
        ax.axhline(0.0, color="0.6", linewidth=0.6, zorder=0)
        for expert in range(num_experts):
            if expert in condensers:
                continue
            colour = palette(expert / max(num_experts - 1, 1) * 0.85)
            ax.plot(steps, values[:, expert], color=colour, linewidth=0.9, alpha=0.65)
        for expert in condensers:
            ax.plot(steps, values[:, expert], color="tab:red", linewidth=2.4, zorder=3)
        named = range(num_experts) if num_experts <= 16 else condensers  # few enough to name every line
        for ids, y in _end_labels(values[-1], list(named), values):
            ours = ",".join(f"e{e}" for e in ids if e in condensers)
            others = ",".join(f"e{e}" for e in ids if e not in condensers)
            if ours:  # condensers in bold red, other experts ending at the same place in grey after them
                ax.annotate(ours, (steps[-1], y), xytext=(3, 0), textcoords="offset points", va="center",
                            color="tab:red", fontsize=8, fontweight="bold")
            if others:
                ax.annotate(others, (steps[-1], y), xytext=(3 + 6 * len(ours) + 4 * bool(ours), 0),
                            textcoords="offset points", va="center", color="0.35", fontsize=6.5)
        chosen = trajectory.chosen_at.get(layer)
        if chosen is not None:
            ax.axvline(chosen, color="black", linestyle="--", linewidth=1.0, zorder=2)
        label = f"layer {layer}"
        if condensers:
            label += f": condensers {condensers} (step {chosen})"
        ax.set_title(label, fontsize=10)
        ax.grid(True, alpha=0.25)
        if slot % ncols == 0:
            ax.set_ylabel("router bias")
        if slot // ncols == nrows - 1 or slot + ncols >= len(layers):
            ax.set_xlabel("optimizer step")
            ax.tick_params(labelbottom=True)
        ax.margins(x=0.1)
    for slot in range(len(layers), nrows * ncols):
        axes[slot // ncols][slot % ncols].set_visible(False)
    handles = [
        Line2D([], [], color=palette(0.4), linewidth=0.9, label="expert (colour = id)"),
        Line2D([], [], color="tab:red", linewidth=2.4, label="condenser expert"),
        Line2D([], [], color="black", linestyle="--", linewidth=1.0, label="condensers chosen"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=9, frameon=False)
    fig.suptitle(title or "router bias trajectory")
    return _save(fig, path)
