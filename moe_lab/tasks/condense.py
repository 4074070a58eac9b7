"""task=condense: CD-MoE (spec compression.md 3) from one calibration file: expert lists per layer (greedy JS /
random / L1 / PL_Alpha_Hill), a layer order (greedy / Layer Rank / Global Layer Rank; JS / KL / PPL), the
condensed model (or LayerTrim / BlockTrim), memory ratio, export (``load_condensed``) and optional lm-eval."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from omegaconf import DictConfig

from ..compress.calibration import Calibration
from ..compress.condense import condense, export_condensed, to_vanilla
from ..compress.condense_search import (
    EXPERT_BASELINES,
    LAYER_METHODS,
    LayerSearch,
    candidate_count,
    expert_baseline,
    greedy_expert_search,
    layer_rank,
    trim,
    trim_order,
)
from ..compress.dense import export_compressed
from ..models import load_model
from ..moe.patch import atomic_export
from ..moe.view import find_moe_layers
from ..plain import to_plain
from .calibrate import calibration_sequences

log = logging.getLogger(__name__)
METHODS = ("cd_moe", "layer_trim", "block_trim")


def _check(c) -> None:
    if c.method not in METHODS:
        raise ValueError(f"condense.method={c.method!r}: choose one of {', '.join(METHODS)}")
    if c.expert_selection not in EXPERT_BASELINES:
        raise ValueError(f"condense.expert_selection={c.expert_selection!r}: choose one of "
                         f"{', '.join(EXPERT_BASELINES)}")
    if c.layer_selection not in LAYER_METHODS:
        raise ValueError(f"condense.layer_selection={c.layer_selection!r}: choose one of {', '.join(LAYER_METHODS)}")
    if not c.calibration_file and c.method == "cd_moe":
        raise ValueError("condense.calibration_file is not set: run task=calibrate on the same data first and pass "
                         "condense.calibration_file=<its run dir>/calibration.safetensors")


def _expert_lists(model, calibration, batches, c) -> tuple[dict, dict]:
    given = to_plain(c.experts)
    if given:
        return {int(k): [int(e) for e in v] for k, v in given.items()}, {}
    routed = int(c.routed_experts)
    if routed == 0:
        return {}, {}
    if c.expert_selection == "greedy":
        lists = greedy_expert_search(model, calibration, batches, routed, metric=c.expert_metric,
                                     fallback=c.fallback_gate, store_outputs=bool(c.store_expert_outputs),
                                     hf_hidden_states=bool(c.hf_hidden_states))
        return dict(lists), lists.losses
    return expert_baseline(model, calibration, c.expert_selection, routed, seed=int(c.seed),
                           fallback=c.fallback_gate), {}


def _layer_order(model, calibration, batches, experts, c) -> tuple[list[int], list[float]]:
    if c.layers:
        return [int(i) for i in c.layers], []
    n = int(c.num_layers)
    if c.method != "cd_moe":
        return trim_order(model, batches, "moe" if c.method == "layer_trim" else "block")[:n], []
    if c.layer_selection == "layer_rank":
        return layer_rank(model, calibration, batches, experts, c.fallback_gate)[:n], []
    search = LayerSearch(model, calibration, batches, experts, target=c.target, metric=c.metric,
                         fallback=c.fallback_gate)
    if c.layer_selection == "global_layer_rank":
        return search.global_rank()[:n], []
    return search.greedy(n)


def _export(model, tokenizer, c, calibration, path: Path) -> tuple[str, str]:
    """``condense.export``: auto (vanilla HF where :func:`to_vanilla` can express it, else the condensed
    format), vanilla, or condensed (``load_condensed``)."""
    fmt = "auto" if c.export is True else str(c.export)
    if fmt not in ("auto", "vanilla", "condensed"):
        raise ValueError(f"condense.export={c.export!r}: choose true/auto, vanilla, condensed or false")
    extra = {"knobs": to_plain(c), "calibration": calibration.manifest}
    if fmt != "condensed":
        try:
            vanilla = to_vanilla(model)
        except ValueError as error:
            if fmt == "vanilla":
                raise
            log.info("condensed export (no vanilla form: %s)", error)
        else:
            vanilla.moe_lab_manifest.update(extra)
            return str(export_compressed(vanilla, path, tokenizer)), "vanilla"
    written = atomic_export(path, lambda tmp: export_condensed(model, tmp, tokenizer, extra=extra))
    return str(written), "condensed"


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def condense_task(cfg: DictConfig) -> dict:
    """Search, condense (or trim), export and evaluate ``cfg.model``; writes summary.json."""
    c = cfg.condense
    _check(c)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    model, tokenizer = load_model(cfg.model)
    model.eval()
    calibration = Calibration.load(c.calibration_file) if c.calibration_file else None
    batches, source = calibration_sequences(c.search.dataset, tokenizer, c.search)
    view = find_moe_layers(model)[0]
    before = _count(model)
    experts, expert_losses = ({}, {}) if c.method != "cd_moe" else _expert_lists(model, calibration, batches, c)
    searched = time.time()
    order, layer_losses = _layer_order(model, calibration, batches, experts, c)
    if c.method == "cd_moe":
        condense(model, calibration, order, experts, fallback=c.fallback_gate)
    else:
        trim(model, order, "moe" if c.method == "layer_trim" else "block")
    after = _count(model)
    summary = {"method": c.method, "routed_experts": int(c.routed_experts), "layers": order,
               "layer_losses": layer_losses, "experts": {str(k): v for k, v in experts.items()},
               "expert_losses": {str(k): v for k, v in expert_losses.items()},
               "candidates_per_layer": candidate_count(view.num_experts, int(c.routed_experts)),
               "params_before": before, "params_after": after, "memory_ratio": after / before,
               "search_data": source, "expert_search_s": round(searched - start, 2),
               "layer_search_s": round(time.time() - searched, 2)}
    print(f"==== moe-lab condense ({c.method}): layers {order}, memory ratio {100 * after / before:.2f}%", flush=True)
    if c.export and c.method == "cd_moe":
        summary["export"], summary["export_format"] = _export(model, tokenizer, c, calibration, out / "export")
    if c.eval.tasks:
        from ..eval.lm_eval_bridge import evaluate_with_lm_eval, lm_eval_metrics
        from .cd_moe_sft import results_table, task_source

        result = evaluate_with_lm_eval(model, tokenizer, list(c.eval.tasks), limit=c.eval.limit,
                                       batch_size=int(c.eval.batch_size), hub_tasks=bool(c.eval.hub_tasks),
                                       data_dir=cfg.paths.get("data_dir"))
        summary["eval"] = lm_eval_metrics(result)
        # the results table and the settings python -m experiments.collect matches (reported.csv `row`, `eval`)
        label = c.method if c.method != "cd_moe" else "cd_moe_s" if int(c.routed_experts) == 0 else "cd_moe_sr"
        table = results_table(summary["eval"], list(c.eval.tasks), cfg.model.name, label)
        summary.update(table=table.to_json(), columns=table.columns, limit=c.eval.limit, eval_settings={
            "name": "lm_eval", "layers": len(order), "routed_experts": int(c.routed_experts),
            "expert_selection": c.expert_selection, "layer_selection": c.layer_selection,
            "task_source": task_source(list(c.eval.tasks))})
    summary["wall_time_s"] = round(time.time() - start, 2)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
