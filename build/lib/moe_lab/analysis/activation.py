"""Activation statistics of routed experts (Condenser paper App. L, Figs. 3 and 5; compression spec 4.5):
selection counts under the model's installed routing, sorted activation shares, Lorenz curves, Gini (per layer,
mean, pooled), tail share, count heatmaps."""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.figure import Figure

from .load_stats import gini
from .report import save_figure


def count_selections(patch, batches) -> dict[int, torch.Tensor]:
    """{MoE layer index: int64 [E] (token, slot) selections} of the real (non-pad) tokens of ``batches`` (dicts
    with ``input_ids`` and optional ``attention_mask``) under the routing ``patch`` installed: a method's own
    (Expert Condenser's biases and forced condensers, Compressed Experts' main experts), or the family's top-k
    for a plain patch. The blocks count the indices their router returns, in eval mode, without gradients."""
    model = patch.model
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    patch.reset_counts()
    try:
        with torch.no_grad(), patch.calibration():
            for batch in batches:
                mask = batch.get("attention_mask")
                model(input_ids=batch["input_ids"].to(device), use_cache=False,
                      attention_mask=None if mask is None else mask.to(device))
    finally:
        model.train(was_training)
    counts = {layer.index: layer.counts.detach().cpu().clone() for layer in patch.layers}
    patch.reset_counts()
    return counts


def shares(counts: torch.Tensor) -> torch.Tensor:
    """a_e = count_e / sum count (share of routed assignments), fp64."""
    c = counts.to(torch.float64)
    return c / c.sum(-1, keepdim=True)


def lorenz(counts: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(x, L(x)): x = i/E, L = cumulative share of the i least-used experts, with L(0) = 0."""
    a = np.sort(shares(counts).numpy())
    return np.arange(len(a) + 1) / len(a), np.concatenate([[0.0], np.cumsum(a) / a.sum()])


def tail_share(counts: torch.Tensor, tau: float = 0.02) -> tuple[float, float]:
    """(share of assignments held by experts with a_e < tau, fraction of experts they are)."""
    a = shares(counts)
    tail = a < tau
    return float(a[tail].sum()), float(tail.double().mean())


def layer_stats(counts: dict[int, torch.Tensor], tau: float) -> tuple[list[dict], dict]:
    """Per-layer Gini and tail share, and the summary: mean per-layer Gini and the pooled Gini over all
    (layer, expert) pairs (A0-4)."""
    rows = []
    for layer, c in sorted(counts.items()):
        share, frac = tail_share(c, tau)
        rows.append({"layer": layer, "gini": float(gini(c)), "tail_share": share, "tail_experts": frac,
                     "assignments": int(c.sum())})
    pooled = torch.cat([shares(c) for _, c in sorted(counts.items())])
    share, frac = tail_share(torch.cat([c for _, c in sorted(counts.items())]), tau / len(counts))
    return rows, {"gini_mean": float(np.mean([r["gini"] for r in rows])), "gini_pooled": float(gini(pooled)),
                  "tail_share_pooled": share, "tail_experts_pooled": frac}


def distribution_figure(counts: dict[int, torch.Tensor], path, title: str, summary: dict) -> object:
    """Sorted activation shares (per layer, faint; pooled, bold) and Lorenz curves with the diagonal."""
    fig = Figure(figsize=(11, 4.2), dpi=150, layout="constrained")
    ax, bx = fig.subplots(1, 2)
    for layer, c in sorted(counts.items()):
        a = np.sort(shares(c).numpy())[::-1]
        ax.plot(np.arange(1, len(a) + 1), a, color="#4C72B0", alpha=0.25, linewidth=0.8)
        x, y = lorenz(c)
        bx.plot(x, y, color="#4C72B0", alpha=0.25, linewidth=0.8)
    pooled = torch.cat([shares(c) for _, c in sorted(counts.items())])
    a = np.sort(pooled.numpy())[::-1]  # per-layer shares of every (layer, expert) pair
    ax.plot(np.linspace(1, len(next(iter(counts.values()))), len(a)), a, color="#C44E52", linewidth=2,
            label="pooled (all layers)")
    ax.set_yscale("log")
    ax.set_xlabel("expert rank (most used first)")
    ax.set_ylabel("share of routed assignments")
    ax.set_title("Sorted activation rates (thin: one per layer)", fontsize=10)
    ax.legend(frameon=False, fontsize=8)
    x, y = lorenz(pooled)
    bx.plot(x, y, color="#C44E52", linewidth=2, label=f"pooled, Gini {summary['gini_pooled']:.2f}")
    bx.plot([0, 1], [0, 1], color="black", linestyle="--", linewidth=0.8, label="equality")
    bx.set_xlabel("fraction of experts (least used first)")
    bx.set_ylabel("cumulative share of assignments")
    bx.set_title(f"Lorenz curves (mean per-layer Gini {summary['gini_mean']:.2f})", fontsize=10)
    bx.legend(frameon=False, fontsize=8, loc="upper left")
    for axis in (ax, bx):
        axis.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path)


def heatmap_figure(runs: dict[str, dict[int, torch.Tensor]], path, title: str) -> object:
    """Layer x expert selection counts, one panel per run, one shared colour scale."""
    mats = {name: torch.stack([c for _, c in sorted(counts.items())]).double().numpy() for name, counts in runs.items()}
    vmax = max(m.max() for m in mats.values())
    first = next(iter(runs.values()))
    fig = Figure(figsize=(11, 1.2 + 0.28 * len(first) * len(runs) + 0.6 * len(runs)), dpi=150, layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(runs), 1, sharex=True))
    for ax, (name, m) in zip(axes, mats.items()):
        image = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_yticks(range(len(m)), [str(k) for k in sorted(runs[name])], fontsize=7)
        ax.set_ylabel("MoE layer")
        ax.set_title(name, fontsize=10, loc="left")
    axes[-1].set_xlabel("expert")
    fig.colorbar(image, ax=list(axes), label="selections (tokens)", shrink=0.9)
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path)
