"""task=activation_stats: activation shares, Lorenz curves, Gini and tail share of routed experts, and a
layer x expert count heatmap over several runs (Condenser paper App. L, Figs. 3 and 5; spec 4.5).

Each run is counted under the routing the trained model uses: an export directory is loaded with the method
routing it carries (``install_exported_routing``: Expert Condenser biases and condensers, Compressed Experts'
main experts) and its selections are counted on ``task.dataset``; a model without such routing is counted under
its family's top-k. A ``calibration.safetensors`` (task=calibrate) holds vanilla top-k counts only: accepted,
with a line saying so."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ..analysis.activation import count_selections, distribution_figure, heatmap_figure, layer_stats
from ..analysis.report import log_images, markdown_table, write_csv
from ..analysis.run_method import computes_every_expert, trained_method
from ..core.atomic import atomic_write_json, atomic_write_text
from ..methods.registry import EXPORT_LOADERS

PLAIN = "family top-k"


def _calibration_counts(path: str) -> tuple[dict[int, torch.Tensor], int]:
    """({layer: top-k counts}, real tokens) of a task=calibrate file."""
    from ..compress.calibration import Calibration

    cal = Calibration.load(path)
    counts = {layer: stats["count"].to(torch.int64) for layer, stats in cal.layers.items()}
    return counts, int(next(iter(cal.layers.values()))["n"])


def _export_dir(path) -> Path | None:
    """``path`` when it is a local model directory (config.json), else None (a hub id, a random model)."""
    p = Path(str(path)).expanduser() if path else None
    return p if p is not None and (p / "config.json").is_file() else None


def _all_experts_if_densemixer(label: str, where: str, export: Path, dense: set) -> None:
    """Count ``label`` with every expert active when the run that wrote ``export`` was DenseMixer (one line)."""
    method = trained_method(export.parent)
    if label not in dense and computes_every_expert(method):
        dense.add(label)
        print(f"activation_stats: {where} was trained with method={method}: every expert is active (DenseMixer "
              "computes all experts on every token)", flush=True)


def _installed(cfg: DictConfig, export: Path | None):
    """(patch, routing label): ``cfg.model`` (or the export) loaded with the method routing it carries."""
    from ..methods.registry import apply, install_exported_routing
    from ..models import load_model

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    if export is not None and str(export) != str(model_cfg.get("pretrained")):
        has_tokenizer = any((export / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        model_cfg = {"pretrained": str(export), "dtype": model_cfg.get("dtype"),
                     "tokenizer": str(export) if has_tokenizer else model_cfg.get("tokenizer")}
    model, tokenizer = load_model(model_cfg)
    patch = install_exported_routing(model, export) if export is not None else None
    if patch is None:
        return apply(model, "sft"), tokenizer, PLAIN
    files = [f for f in EXPORT_LOADERS if (export / f).is_file()]
    forced = {layer.index: layer.forced_experts for layer in patch.layers if layer.forced_experts}
    label = f"{patch.method} ({', '.join(files)})" + (f", forced experts {forced}" if forced else "")
    return patch, tokenizer, label


def _count_run(cfg: DictConfig, export: Path | None) -> tuple[dict[int, torch.Tensor], int, str]:
    """({layer: counts}, real tokens, routing) of one model counted on ``task.dataset``."""
    from ..runs.calibrate import calibration_sequences

    patch, tokenizer, routing = _installed(cfg, export)
    batches, _ = calibration_sequences(cfg.task.dataset, tokenizer, cfg.task.calibration)
    tokens = sum(int(b["attention_mask"].sum()) if b.get("attention_mask") is not None else b["input_ids"].numel()
                 for b in batches)
    return count_selections(patch, batches), tokens, routing


def _counts(cfg: DictConfig, runs: dict, dense: set) -> tuple[dict, dict]:
    """Per run: {layer: counts} (every expert counted on every token for the ``dense`` runs) and the routing
    it was counted under."""
    counts, routing = {}, {}
    for label, path in runs.items():
        export = _export_dir(path)
        if export is not None:
            _all_experts_if_densemixer(label, f"task.runs.{label}", export, dense)
            counts[label], tokens, routing[label] = _count_run(cfg, export)
        elif Path(str(path)).is_file():
            (counts[label], tokens), routing[label] = _calibration_counts(str(path)), "calibration file (vanilla top-k)"
            print(f"activation_stats: task.runs.{label}={path} is a calibration file: its counts are the model's "
                  "vanilla top-k routing; a method's own routing (condensers, main experts) is counted only from "
                  "its export directory (task.runs.{label}=<run>/export)", flush=True)
        else:
            raise FileNotFoundError(f"task.runs.{label}={path} does not exist: give an export directory (counted "
                                    "here under its own routing) or a calibration.safetensors, or leave task.runs "
                                    "empty to count model on task.dataset here")
        if label in dense:
            counts[label] = {layer: torch.full_like(c, tokens) for layer, c in counts[label].items()}
            routing[label] += "; all experts active"
    return counts, routing


def activation_stats_task(cfg: DictConfig) -> dict:
    """Write activation_counts.csv, activation_layers.csv, activation.md, activation.png (first run) and
    activation_heatmap.png."""
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = cfg.task
    runs = OmegaConf.to_container(t.runs) or {}
    dense = set(t.get("all_experts_runs") or [])
    unknown = dense - (set(runs) or {cfg.model.name})
    if unknown:
        raise ValueError(f"task.all_experts_runs names {sorted(unknown)}, not in task.runs "
                         f"({sorted(runs) or [cfg.model.name]})")
    if runs:
        counts, routing = _counts(cfg, runs, dense)
    else:  # the model itself, with the routing its checkpoint carries
        label, export = cfg.model.name, _export_dir(cfg.model.get("pretrained"))
        if export is not None:
            _all_experts_if_densemixer(label, f"model.pretrained={export}", export, dense)
        layers, tokens, how = _count_run(cfg, export)
        if label in dense:
            layers, how = {k: torch.full_like(c, tokens) for k, c in layers.items()}, how + "; all experts active"
        counts, routing = {label: layers}, {label: how}
    for label, how in routing.items():
        print(f"activation_stats: {label}: counted under {how}", flush=True)
    layers = {label: sorted(c) for label, c in counts.items()}
    if len({tuple(v) for v in layers.values()}) > 1:
        raise ValueError(f"task.runs have different MoE layers: {layers}")
    write_csv([{"run": label, "layer": layer, "expert": e, "selections": int(v)} for label, c in counts.items()
               for layer, row in sorted(c.items()) for e, v in enumerate(row.tolist())], out / "activation_counts.csv")
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
    table = [{"run": k, **v, "routing": routing[k]} for k, v in summaries.items()]
    text = [f"# Expert activation statistics: {cfg.model.name}\n",
            (f"Shares of routed assignments per layer, counted under each run's own routing (column routing); "
             f"Gini per layer (mean) and over all (layer, expert) pairs (pooled); tail = experts below "
             f"{float(t.tail_threshold):.0%} of a layer's assignments. Runs with all experts active (DenseMixer): "
             f"{sorted(dense) or 'none'}.\n"),
            markdown_table(table, {"run": "run", "gini_mean": "Gini (mean per layer)", "gini_pooled": "Gini (pooled)",
                                   "tail_share_pooled": "tail share of assignments",
                                   "tail_experts_pooled": "tail fraction of experts", "routing": "routing"},
                           {k: ".3f" for k in ("gini_mean", "gini_pooled", "tail_share_pooled",
                                               "tail_experts_pooled")})]
    atomic_write_text(out / "activation.md", "\n".join(text))
    summary = {f"activation/{k}/{m}": v for k, s in summaries.items() for m, v in s.items()}
    atomic_write_json(out / "summary.json", summary, indent=2)
    log_images(cfg, images, summary)
    print(f"==== moe-lab activation_stats: {len(counts)} runs -> {out / 'activation.md'}", flush=True)
    return summary
