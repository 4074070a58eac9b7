"""task=correlation: down_proj Pearson correlation between condenser and regular experts, per checkpoint,
as change against the base model (Condenser paper App. I, Fig. 4; compression spec 4.6)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from omegaconf import DictConfig, OmegaConf

from ..analysis.correlation import check_same_architecture, deltas, down_correlations, signature, summarise
from ..analysis.report import log_images, markdown_table, save_figure, write_csv
from ..core.atomic import atomic_write_json, atomic_write_text
from ..models import load_model

COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]


def _load(cfg: DictConfig, label: str, path: str):
    model_cfg = OmegaConf.merge(cfg.model, {"pretrained": str(path)})
    model, _ = load_model(model_cfg)
    return model


def _condensers(t, checkpoints: dict) -> dict[int, list[int]]:
    from ..compress.prune import condensers_from_export

    if t.get("condensers"):
        return {int(k): [int(e) for e in v] for k, v in OmegaConf.to_container(t.condensers).items()}
    source = t.get("condenser_file") or checkpoints.get("condenser")
    if not source:
        raise ValueError("task.condensers: give {layer: [expert ids]}, task.condenser_file (a condenser.json) or a "
                         "task.checkpoints.condenser export holding condenser.json")
    return condensers_from_export(source)


def figure(rows: list[dict], layer: int, path: Path, title: str) -> Path:
    """One panel per condenser expert of ``layer``: delta % per regular expert, methods side by side."""
    sel = [r for r in rows if r["layer"] == layer]
    shared = sorted({r["condenser"] for r in sel})
    methods = list(dict.fromkeys(r["method"] for r in sel))
    experts = sorted({r["expert"] for r in sel})
    fig = Figure(figsize=(max(8, 0.22 * len(experts) * len(methods) + 2), 2.6 * len(shared)), dpi=150,
                 layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(shared), 1, sharex=True))
    width = 0.8 / len(methods)
    x = np.arange(len(experts))
    for ax, i in zip(axes, shared):
        for m, method in enumerate(methods):
            values = {r["expert"]: r["delta_pct"] for r in sel if r["condenser"] == i and r["method"] == method}
            ax.bar(x + (m - (len(methods) - 1) / 2) * width, [values.get(j, np.nan) for j in experts], width,
                   color=COLOURS[m % len(COLOURS)], label=method)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_ylabel("Δ corr. vs base (%)")
        ax.set_title(f"condenser expert {i}", fontsize=10, loc="left")
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].legend(frameon=False, fontsize=8, ncols=len(methods))
    step = max(1, len(experts) // 32)
    axes[-1].set_xticks(x[::step], [str(e) for e in experts][::step], fontsize=7)
    axes[-1].set_xlabel("regular expert")
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path)


def correlation_task(cfg: DictConfig) -> dict:
    """Write correlation.csv (every pair), correlation_layers.csv, correlation.md and correlation.png."""
    out = Path(cfg.paths.output_dir)
    t = cfg.task
    checkpoints = OmegaConf.to_container(t.checkpoints) or {}
    if "base" not in checkpoints or len(checkpoints) < 2:
        raise ValueError("task.checkpoints needs base: <path> and at least one fine-tuned checkpoint "
                         "(e.g. esft: <path>, condenser: <path>), all of the same model")
    condensers = _condensers(t, checkpoints)
    mats, sigs = {}, {}
    for label, path in checkpoints.items():
        model = _load(cfg, label, path)
        sigs[label] = signature(model, f"task.checkpoints.{label}={path}")
        if label != "base":
            check_same_architecture(sigs["base"], sigs[label])
        mats[label] = down_correlations(model)
        del model
        gc.collect()
    base = mats.pop("base")
    rows, skipped = deltas(base, mats, condensers)
    layer_rows, model_rows = summarise(rows)
    write_csv(rows, out / "correlation.csv")
    write_csv(layer_rows, out / "correlation_layers.csv")
    layer = int(t.plot_layer) if t.get("plot_layer") is not None else min(base)
    if layer not in base:
        raise ValueError(f"task.plot_layer={layer} is not an MoE layer: choose one of {sorted(base)}")
    title = f"{cfg.model.name}: down_proj correlation change vs base, MoE layer {layer}"
    png = figure(rows, layer, out / "correlation.png", title)
    text = [f"# Down-projection correlation vs base: {cfg.model.name}\n",
            (f"Pairs (condenser i, regular j) per layer; Δ = 100 (C − C_base) / |C_base|. Pairs with C_base = 0 "
            f"skipped: {skipped}. Condensers: {json.dumps({str(k): v for k, v in sorted(condensers.items())})}.\n"),
            "## Model mean and std over layers (population std)\n",
            markdown_table(model_rows, {"method": "method", "mean": "mean Δ (%)", "std": "std over layers"},
                           {"mean": ".4f", "std": ".4f"}),
            "\n## Layer means\n",
            markdown_table(layer_rows, {"method": "method", "layer": "layer", "delta_pct": "mean Δ (%)"},
                           {"delta_pct": ".4f"})]
    atomic_write_text(out / "correlation.md", "\n".join(text))
    summary = {f"correlation/{r['method']}/mean": r["mean"] for r in model_rows}
    summary |= {f"correlation/{r['method']}/std": r["std"] for r in model_rows}
    summary["correlation/skipped_pairs"] = skipped
    atomic_write_json(out / "summary.json", summary, indent=2)
    log_images(cfg, {"correlation/layer": png}, summary)
    print(f"==== moe-lab correlation: {len(rows)} pairs, {skipped} skipped -> {out / 'correlation.md'}", flush=True)
    return summary
