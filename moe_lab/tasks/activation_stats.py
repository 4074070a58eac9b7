"""task=activation_stats: activation shares, Lorenz curves, Gini and tail share of routed experts, and a
layer x expert count heatmap over several runs (Condenser paper App. L, Figs. 3 and 5; spec 4.5)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ..analysis.activation import distribution_figure, heatmap_figure, layer_stats
from ..analysis.report import log_images, markdown_table, write_csv


def _counts(path: str, label: str, all_experts: bool) -> dict[int, torch.Tensor]:
    from ..compress.calibration import Calibration

    if not Path(path).is_file():
        raise FileNotFoundError(f"task.runs.{label}={path} does not exist: give a calibration.safetensors written "
                                "by task=calibrate (model.pretrained=<the run's export>) for each run, or leave "
                                "task.runs empty to calibrate model on task.dataset here")
    cal = Calibration.load(path)
    out = {}
    for layer, stats in cal.layers.items():
        count = stats["count"].to(torch.int64)
        # DenseMixer computes every expert on every token: its active (resident) set is all experts
        out[layer] = torch.full_like(count, int(stats["n"])) if all_experts else count
    return out


def _calibrate_model(cfg: DictConfig, out: Path) -> Path:
    """One calibration pass of ``cfg.model`` over ``task.dataset`` (``moe_lab.compress.calibrate``)."""
    from ..compress.calibration import calibrate
    from ..models import load_model
    from .calibrate import calibration_sequences

    c = cfg.task.calibration
    model, tokenizer = load_model(cfg.model)
    batches, source = calibration_sequences(cfg.task.dataset, tokenizer, c)
    cal = calibrate(model, batches, max_chunk_tokens=int(c.max_chunk_tokens),
                    memory_budget_mb=float(c.memory_budget_mb), data_source=source)
    return cal.save(out / "calibration.safetensors")


def activation_stats_task(cfg: DictConfig) -> dict:
    """Write activation_layers.csv, activation.md, activation.png (first run) and activation_heatmap.png."""
    out = Path(cfg.paths.output_dir)
    t = cfg.task
    runs = OmegaConf.to_container(t.runs) or {}
    if not runs:
        runs = {cfg.model.name: str(_calibrate_model(cfg, out))}
    dense = set(t.get("all_experts_runs") or [])
    unknown = dense - set(runs)
    if unknown:
        raise ValueError(f"task.all_experts_runs names {sorted(unknown)}, not in task.runs ({sorted(runs)})")
    counts = {label: _counts(path, label, label in dense) for label, path in runs.items()}
    layers = {label: sorted(c) for label, c in counts.items()}
    if len({tuple(v) for v in layers.values()}) > 1:
        raise ValueError(f"task.runs have different MoE layers: {layers}")
    rows, summaries = [], {}
    for label, c in counts.items():
        per_layer, summary = layer_stats(c, float(t.tail_threshold))
        rows += [{"run": label, **r} for r in per_layer]
        summaries[label] = summary
    write_csv(rows, out / "activation_layers.csv")
    first = next(iter(counts))
    images = {"activation/distribution": distribution_figure(
        counts[first], out / "activation.png", f"{cfg.model.name} ({first}): expert activation", summaries[first])}
    images["activation/heatmap"] = heatmap_figure(counts, out / "activation_heatmap.png",
                                                  f"{cfg.model.name}: expert selections per layer (shared scale)")
    table = [{"run": k, **v} for k, v in summaries.items()]
    text = [f"# Expert activation statistics: {cfg.model.name}\n",
            (f"Shares of routed assignments per layer; Gini per layer (mean) and over all (layer, expert) pairs "
            f"(pooled); tail = experts below {float(t.tail_threshold):.0%} of a layer's assignments. Runs with all "
            f"experts active (DenseMixer): {sorted(dense) or 'none'}.\n"),
            markdown_table(table, {"run": "run", "gini_mean": "Gini (mean per layer)", "gini_pooled": "Gini (pooled)",
                                   "tail_share_pooled": "tail share of assignments",
                                   "tail_experts_pooled": "tail fraction of experts"},
                           {k: ".3f" for k in ("gini_mean", "gini_pooled", "tail_share_pooled",
                                               "tail_experts_pooled")})]
    (out / "activation.md").write_text("\n".join(text))
    summary = {f"activation/{k}/{m}": v for k, s in summaries.items() for m, v in s.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log_images(cfg, images, summary)
    print(f"==== moe-lab activation_stats: {len(runs)} runs -> {out / 'activation.md'}", flush=True)
    return summary
