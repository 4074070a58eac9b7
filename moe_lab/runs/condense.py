"""The run behind task=condense (and the condense stage of task=cd_moe_sft): CD-MoE (docs/specs/compression.md 3)
from one calibration file: expert lists per layer (greedy JS / random / L1 / PL_Alpha_Hill), a layer order
(greedy / Layer Rank / Global Layer Rank; JS / KL / PPL), the condensed model (or LayerTrim / BlockTrim),
memory ratio, export (``load_condensed``) and optional lm-eval."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from ..compress.calibration import Calibration
from ..compress.condense import condense, export_condensed, to_vanilla
from ..compress.condense_search import (
    EXPERT_BASELINES,
    LAYER_METHODS,
    LAYER_METRICS,
    LayerSearch,
    active_params,
    candidate_count,
    expert_baseline,
    greedy_expert_search,
    layer_rank,
    trim,
    trim_order,
)
from ..compress.dense import export_compressed
from ..core.atomic import atomic_write_json
from ..core.plain import to_plain
from ..core.stamped_log import PointLog
from ..models import load_model
from ..moe.view import find_moe_layers
from ..runtime.stop_signal import StopOnSignal
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


#: the knobs the searches' results depend on (besides the model, the calibration and the search data); a re-run
#: into a run directory with other values is refused rather than mixing two searches (num_layers is not one: the
#: greedy layer order of n layers is the first n steps of a longer one)
SEARCH_KNOBS = ("method", "routed_experts", "experts", "expert_selection", "expert_metric", "hf_hidden_states",
                "fallback_gate", "layer_selection", "layers", "metric", "target", "alpha_hill_xmin", "seed")


class SearchLog:
    """The finished steps of the CD-MoE searches (a layer's greedy expert list, a greedy layer step, a layer's
    single-condensation loss) in ``<run dir>/search_progress.csv``, each written as it finishes (atomically:
    :class:`~moe_lab.core.stamped_log.PointLog`, settings in ``search_progress.meta.json``). A re-run into the
    same directory takes them as they are and continues (a kill -9 loses at most the step in hand); on SIGINT /
    SIGTERM / SIGUSR1 (``stop``) the search ends after the step in hand and the task exits with how to resume."""

    FILE = "search_progress.csv"

    def __init__(self, out: Path, settings: dict, stop):
        self.out, self.stop = out, stop
        self.points = PointLog(out / self.FILE, ("stage", "key"), settings)
        self.reused = len(self.points.rows)  # steps of an earlier run, taken as they are
        if self.points.rows:
            print(f"==== moe-lab condense: {len(self.points.rows)} finished search steps in {self.points.path}: "
                  "taken, not recomputed", flush=True)

    def done(self, stage: str) -> dict[int, dict]:
        """``{key: value}`` of the finished steps of ``stage``."""
        return {int(k): json.loads(str(row["value"])) for (s, k), row in self.points.done().items() if s == stage}

    def save(self, stage: str, key: int, **value) -> None:
        self.points.append({"stage": stage, "key": int(key), "value": json.dumps(value)})

    def exit_if_stopped(self, task: str) -> None:
        """After a search stage: on a signal, exit 128 + signum naming the finished steps and how to resume."""
        if not self.stop():
            return
        how = (f"Resume with: the same command and hydra.run.dir={self.out}, or python run.py task.resume={self.out}"
               if task == "condense" else
               f"Resume with: python run.py task.resume={self.out.parent} (task={task}: its finished stages are reused, "
               "this one continues)")
        self.stop.exit(f"{len(self.points.rows)} finished search steps are in {self.points.path}. {how} (finished "
                       "steps are taken, not recomputed)")


def _search_settings(cfg: DictConfig, calibration, source: str) -> dict:
    c = cfg.condense
    return {"model": to_plain(cfg.model), "calibration": calibration.manifest if calibration else None,
            "search_data": source, "search": to_plain(c.search), **{k: to_plain(c.get(k)) for k in SEARCH_KNOBS}}


def _expert_lists(model, calibration, batches, c, log: SearchLog) -> tuple[dict, dict]:
    given = to_plain(c.experts)
    if given:
        return {int(k): [int(e) for e in v] for k, v in given.items()}, {}
    routed = int(c.routed_experts)
    if routed == 0:
        return {}, {}
    if c.expert_selection == "greedy":
        done = {layer: (v["experts"], v["losses"]) for layer, v in log.done("experts").items()}
        lists = greedy_expert_search(model, calibration, batches, routed, metric=c.expert_metric,
                                     fallback=c.fallback_gate, store_outputs=bool(c.store_expert_outputs),
                                     hf_hidden_states=bool(c.hf_hidden_states), done=done, stop=log.stop,
                                     progress=lambda layer, e, losses: log.save("experts", layer, experts=e,
                                                                                losses=losses))
        return dict(lists), lists.losses
    return expert_baseline(model, calibration, c.expert_selection, routed, seed=int(c.seed),
                           fallback=c.fallback_gate, xmin=str(c.alpha_hill_xmin)), {}


def _single_resume(log: SearchLog, metric: str) -> dict:
    """``single_losses``' resume arguments for ``metric``: the finished layers, saving, stopping."""
    return {"done": {layer: v["loss"] for layer, v in log.done(f"single/{metric}").items()},
            "progress": lambda layer, loss: log.save(f"single/{metric}", layer, loss=loss), "stop": log.stop}


def _layer_order(model, calibration, batches, experts, c, log: SearchLog) -> tuple[list[int], list[float]]:
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
        return search.global_rank(**_single_resume(log, c.metric))[:n], []
    done = [(v["layer"], v["loss"]) for _, v in sorted(log.done("layers").items())]
    return search.greedy(n, done, stop=log.stop,
                         progress=lambda step, layer, loss: log.save("layers", step, layer=layer, loss=loss))


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
    return str(export_condensed(model, path, tokenizer, extra=extra)), "condensed"


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def single_layer_losses(model, calibration, batches, experts, c, log: SearchLog) -> dict[str, dict[int, float]]:
    """``{metric: {layer: final-output loss of condensing that layer alone}}`` for ``condense.layer_loss_metrics``
    (the paper's Fig. 2: JS; Fig. 5: KL and PPL)."""
    metrics = [str(m) for m in (c.layer_loss_metrics or [])]
    bad = [m for m in metrics if m not in LAYER_METRICS]
    if bad:
        raise ValueError(f"condense.layer_loss_metrics={metrics}: {bad} unknown, choose from {', '.join(LAYER_METRICS)}")
    out = {}
    for m in metrics:
        out[m] = LayerSearch(model, calibration, batches, experts, target=c.target, metric=m,
                             fallback=c.fallback_gate).single_losses(**_single_resume(log, m))
        if log.stop():
            break
    return out


def write_layer_losses(losses: dict[str, dict[int, float]], out: Path, label: str) -> list[Path]:
    """``layer_losses.csv`` (one row per MoE layer, one column per metric) and ``layer_losses.png`` (one panel
    per metric against the MoE-layer index, as the paper's Figs. 2 and 5), both atomic."""
    from matplotlib.figure import Figure

    from ..analysis.report import save_figure, write_csv

    layers = sorted(next(iter(losses.values())))
    rows = [{"decoder_layer": i, "moe_layer": n, **{m: v[i] for m, v in losses.items()}}
            for n, i in enumerate(layers)]
    write_csv(rows, out / "layer_losses.csv")  # atomic
    names = {"js": "JS divergence", "kl": "KL divergence", "ppl": "perplexity change"}
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(4.8 * len(losses), 3.4))
    fig.subplots_adjust(wspace=0.45)
    for k, (metric, values) in enumerate(losses.items()):
        ax = fig.add_subplot(1, len(losses), k + 1)
        ax.plot(range(len(layers)), [values[i] for i in layers], marker="o", ms=3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.set_xlabel("condensed MoE layer (alone)")
        ax.set_ylabel(names[metric])
        ax.set_title(f"{label}: {names[metric]}", fontsize=9)
    return [out / "layer_losses.csv", save_figure(fig, out / "layer_losses.png")]


@torch.no_grad()
def forward_seconds(model, batches) -> float:
    """Wall time of one forward pass over ``batches`` (after one warm-up batch), synchronising CUDA."""
    from ..compress.condense_search import _run

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    _run(model, batches[0])
    sync()
    start = time.perf_counter()
    for batch in batches:
        _run(model, batch)
    sync()
    return time.perf_counter() - start


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
    before, active_before = _count(model), active_params(model)
    seconds_before = forward_seconds(model, batches) if c.measure_speed else None
    with StopOnSignal("the condense search") as stop:
        log = SearchLog(out, _search_settings(cfg, calibration, source), stop)
        experts, expert_losses = ({}, {}) if c.method != "cd_moe" else _expert_lists(model, calibration, batches, c,
                                                                                     log)
        log.exit_if_stopped(cfg.task.name)
        searched = time.time()
        order, layer_losses = _layer_order(model, calibration, batches, experts, c, log)
        log.exit_if_stopped(cfg.task.name)
        layer_searched = time.time()
        single = single_layer_losses(model, calibration, batches, experts, c, log) if c.method == "cd_moe" else {}
        log.exit_if_stopped(cfg.task.name)
    if c.method == "cd_moe":
        condense(model, calibration, order, experts, fallback=c.fallback_gate)
    else:
        trim(model, order, "moe" if c.method == "layer_trim" else "block")
    after, active_after = _count(model), active_params(model)
    summary = {"method": c.method, "routed_experts": int(c.routed_experts), "layers": order,
               "layer_losses": layer_losses, "experts": {str(k): v for k, v in experts.items()},
               "expert_losses": {str(k): v for k, v in expert_losses.items()},
               "single_layer_losses": {m: {str(k): v for k, v in d.items()} for m, d in single.items()},
               "candidates_per_layer": candidate_count(view.num_experts, int(c.routed_experts)),
               "params_before": before, "params_after": after, "memory_ratio": after / before,
               "active_params_before": active_before, "active_params_after": active_after,
               "search_data": source, "expert_search_s": round(searched - start, 2),
               "layer_search_s": round(layer_searched - searched, 2), "search_steps_reused": log.reused,
               "search_progress": str(log.points.path) if log.points.rows else None}
    if seconds_before is not None:
        seconds_after = forward_seconds(model, batches)
        summary.update(forward_s_before=round(seconds_before, 4), forward_s_after=round(seconds_after, 4),
                       speedup=seconds_before / seconds_after, speedup_device=str(next(model.parameters()).device))
    if single:
        summary["layer_loss_files"] = [str(p) for p in write_layer_losses(single, out, cfg.model.name)]
    speed = f", speed-up {summary['speedup']:.2f}x" if "speedup" in summary else ""
    print(f"==== moe-lab condense ({c.method}): layers {order}, memory ratio {100 * after / before:.2f}%, "
          f"active params {active_after:,} of {active_before:,}{speed}", flush=True)
    if c.export and c.method == "cd_moe":
        summary["export"], summary["export_format"] = _export(model, tokenizer, c, calibration, out / "export")
    if c.eval.tasks:
        from ..eval.lm_eval_bridge import evaluate_with_lm_eval, lm_eval_metrics
        from ..eval.lm_eval_table import results_table, task_source

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
    atomic_write_json(out / "summary.json", summary, default=str)
    return summary
