"""task=expert_removal: the Condenser paper's expert-removal study (spec 4.2-4.4): Small Dense n', Small MoE n',
Inference Reduce k' with ES-Act / ES-Mag, each pruned model evaluated with ``eval=`` (math7), the paper's table
layout, accuracy vs retained parameters with fits (our addition); condensers always kept with task.always_keep.

The base row is evaluated under the routing the model carries (an export's Expert Condenser biases and condensers,
Compressed Experts' main experts: their files are copied beside the base export); the pruned points under the
pruned model's plain routing (those files name experts of the unpruned layers), said in one line."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig

from ..analysis.meta_costs import count_parameters
from ..analysis.removal import SCORE_LABELS, STRATEGY_LABELS, figure, fit, paper_table
from ..analysis.report import log_images, markdown_table, write_csv
from ..compress.dense import MANIFEST_FILE, export_compressed
from ..core.atomic import atomic_write_json, atomic_write_text
from ..methods.registry import EXPORT_LOADERS
from ..models import load_model
from ..moe.patch import atomic_export
from ..moe.view import find_moe_layers
from ..runs.evaluate import evaluate
from ..runs.stage import stage_config
from ..runtime.stop_signal import StopOnSignal

SCORES = ("es_act", "es_mag")


def plan(t, num_experts: int, top_k: int) -> list[dict]:
    """The study's points: (strategy, n', k', score); k' > n' and out-of-range values refused by field."""
    scores = list(t.scores)
    for s in scores:
        if s not in SCORES:
            raise ValueError(f"task.scores contains {s!r}: choose from {', '.join(SCORES)}")
    points = []
    for n in t.small_dense:
        if not 1 <= int(n) <= num_experts:
            raise ValueError(f"task.small_dense={n}: n' must be in 1..{num_experts}")
        points += [{"strategy": "small_dense", "n": int(n), "k": int(n), "score": s} for s in scores]
    for n in t.small_moe:
        if int(n) < top_k:
            raise ValueError(f"task.small_moe={n}: k'={top_k} > n'={n} (a token cannot select more experts than "
                             f"remain); use n' >= {top_k}, or task.small_dense for n' = k'")
        if int(n) > num_experts:
            raise ValueError(f"task.small_moe={n}: n' must be at most {num_experts}")
        points += [{"strategy": "small_moe", "n": int(n), "k": top_k, "score": s} for s in scores]
    for k in t.inference_reduce:
        if not 1 <= int(k) <= num_experts:
            raise ValueError(f"task.inference_reduce={k}: k' must be in 1..{num_experts}")
        points.append({"strategy": "inference_reduce", "n": num_experts, "k": int(k), "score": None})
    if not points:
        raise ValueError("nothing to sweep: set task.small_dense, task.small_moe and/or task.inference_reduce")
    return points


def _name(p: dict) -> str:
    return f"{p['strategy']}_n{p['n']}_k{p['k']}" + (f"_{p['score']}" if p["score"] else "")


def _evaluate_export(cfg: DictConfig, export: Path, out: Path, label: str) -> dict:
    """task=evaluate of one point's export in the point's folder (a stage config: :func:`~moe_lab.runs.stage.
    stage_config`), no logger; the point's metrics."""
    evaluate(stage_config(cfg, out, logger=None, **{"task.checkpoint": str(export), "task.model_label": cfg.model.name,
                                                    "task.method_label": label}))
    return json.loads((out / "summary.json").read_text())["metrics"]


def routing_files(pretrained) -> list[Path]:
    """The moe-lab routing files (``EXPORT_LOADERS``) beside a local ``model.pretrained`` export; [] otherwise."""
    source = Path(str(pretrained)).expanduser() if pretrained else None
    if source is None or not source.is_dir():
        return []
    return [source / name for name in EXPORT_LOADERS if (source / name).is_file()]


def _row(p: dict, model, metrics: dict) -> dict:
    counts = count_parameters(model)
    accs = {k.split("/")[1]: 100 * v for k, v in metrics.items() if k.startswith("eval/") and k != "eval/avg"}
    return {**p, "params_total": counts.total, "params_active": counts.active(),
            "mean": 100 * metrics["eval/avg"] if "eval/avg" in metrics else float("nan"), **accs}


def _removal_point(cfg: DictConfig, p: dict, model, cal, tokenizer, point_dir: Path) -> dict:
    """Prune ``model`` to point ``p``, export it into ``point_dir`` and evaluate it; its row."""
    from ..compress.prune import prune_experts

    t = cfg.task
    point_dir.mkdir(parents=True, exist_ok=True)
    pruned = prune_experts(model, cal, keep=p["n"], top_k=p["k"], score=p["score"] or "es_act",
                           always_keep=t.get("always_keep"), group_balanced=bool(t.group_balanced))
    export = export_compressed(pruned, point_dir / "export", tokenizer)  # atomic, with its manifest
    atomic_write_json(point_dir / "manifest.json", pruned.moe_lab_manifest)
    row = _row(p, pruned, _evaluate_export(cfg, export, point_dir, _name(p)))
    del pruned
    gc.collect()
    if not t.keep_exports:
        shutil.rmtree(export)
    return row


def expert_removal_task(cfg: DictConfig) -> dict:
    """Write removal_points.csv, removal.md (paper layout + fits), removal.png; one sub-directory per point."""
    from ..compress.calibration import Calibration

    out = Path(cfg.paths.output_dir)
    t = cfg.task
    if cfg.get("eval") is None or not cfg.eval.get("datasets"):
        raise ValueError("task=expert_removal needs an evaluation group: eval=math7 (the paper's seven math sets)")
    model, tokenizer = load_model(cfg.model)
    tokenizer = _saveable(tokenizer)  # written into every export (None: evaluated with model.tokenizer)
    view = find_moe_layers(model)[0]
    points = plan(t, view.num_experts, view.top_k)
    needs_scores = any(p["strategy"] != "inference_reduce" for p in points)
    if needs_scores and not t.get("calibration_file"):
        raise ValueError("task.calibration_file is required for small_dense / small_moe (ES-Act / ES-Mag scores): "
                         "run task=calibrate on the data subset D_s first (the paper: the Math7K training set)")
    cal = Calibration.load(t.calibration_file) if needs_scores else None
    rows = []
    base_dir = out / "points" / "base"
    base_dir.mkdir(parents=True, exist_ok=True)
    routing = routing_files(cfg.model.get("pretrained"))
    export = atomic_export(base_dir / "export", lambda tmp: _write_base(model, tokenizer, routing, tmp))
    if routing:
        names = ", ".join(p.name for p in routing)
        print(f"expert_removal: base row evaluated with the routing of {names}; pruned points with the pruned "
              "model's plain routing (the file's expert ids do not survive pruning)", flush=True)
    rows.append(_row({"strategy": "base", "n": view.num_experts, "k": view.top_k, "score": None}, model,
                     _evaluate_export(cfg, export, base_dir, "base")))
    if not t.keep_exports:
        shutil.rmtree(export)
    with StopOnSignal("the expert-removal study") as stop:
        for p in points:
            if stop():  # after the point in hand; each finished point's predictions are reused by a re-run
                stop.exit(f"{len(rows)} of {len(points) + 1} points finished (their predictions are under "
                          f"{out / 'points'}). Resume with: the same command and hydra.run.dir={out}, or python run.py "
                          f"task.resume={out}")
            rows.append(_removal_point(cfg, p, model, cal, tokenizer, out / "points" / _name(p)))
    df = pd.DataFrame(rows)

    write_csv(df.to_dict("records"), out / "removal_points.csv")  # atomic
    base = df[df.strategy == "base"].iloc[0]
    fits = {}
    for (strategy, score), grp in df[df.strategy.isin(["small_dense", "small_moe"])].groupby(["strategy", "score"]):
        fits[f"{strategy}/{score}"] = fit(grp.params_total.to_numpy(), grp["mean"].to_numpy(),
                                          float(base.params_total), float(base["mean"]))
    png = figure(df, fits, out / "removal.png", f"{cfg.model.name}: expert removal ({cfg.eval.name})")
    table = paper_table(df)
    table["strategy"] = table["strategy"].map(lambda s: STRATEGY_LABELS.get(s, s))
    score_cols = [c for c in table.columns if c not in ("strategy", "n", "k")]
    sets = [c for c in df.columns if c not in ("strategy", "n", "k", "score", "params_total", "params_active", "mean")]
    fit_rows = [{"series": k, "form": f["form"], "status": f["status"], "r2": f.get("r2", float("nan")),
                 "n90": f.get("n_at_90pct_base", float("nan")),
                 "params": json.dumps({a: round(b, 6) for a, b in f.get("params", {}).items()})}
                for k, fs in fits.items() for f in fs]
    text = [f"# Expert removal: {cfg.model.name} ({cfg.eval.name}" +
            (f", first {cfg.eval.limit} rows per set" if cfg.eval.get("limit") is not None else "") + ")\n",
            ("Mean accuracy (%) per (strategy, n', k'), one column per expert score (the paper's Tables 7-8 layout)"
             + (f"; experts of task.always_keep={t.always_keep} always kept (pruning after condensing)"
                if t.get("always_keep") else "") + ".\n"),
            markdown_table(table.to_dict("records"), {"strategy": "strategy", "n": "n'", "k": "k'",
                                                      **{c: c for c in score_cols}}, {c: ".1f" for c in score_cols}),
            "\n## Per dataset\n",
            markdown_table(df.fillna({"score": "-"}).to_dict("records"), {"strategy": "strategy", "n": "n'", "k": "k'", "score": "score",
                                                   "params_total": "total params", **{s: s for s in sets},
                                                   "mean": "mean"},
                           {"params_total": ",", "mean": ".1f", **{s: ".1f" for s in sets}}),
            "\n## Fits (our addition: the paper reports no functional form)\n",
            ("logistic: acc = c + (a - c) / (1 + exp(-b (ln N - ln N0))); power law: acc = a - b (N / N_base)^-gamma; "
            "n90 = parameters at which the fit reaches 90% of the base accuracy.\n"),
            markdown_table(fit_rows, {"series": "series", "form": "form", "status": "status", "r2": "R²",
                                      "n90": "N at 90% base", "params": "parameters"}, {"r2": ".4f", "n90": ".4g"})
            if fit_rows else "no Small Dense / Small MoE series to fit\n"]
    atomic_write_text(out / "removal.md", "\n".join(text))
    summary = {"removal/base/mean": float(base["mean"])}
    summary |= {f"removal/{r['strategy']}/n{r['n']}_k{r['k']}" + (f"/{r['score']}" if r["score"] else ""): r["mean"]
                for r in rows[1:]}
    atomic_write_json(out / "removal_summary.json", {"points": summary, "fits": fits}, default=str)
    log_images(cfg, {"removal/accuracy_vs_params": png}, summary)
    print(f"==== moe-lab expert_removal: {len(rows) - 1} points -> {out / 'removal.md'}", flush=True)
    return summary


def _saveable(tokenizer):
    """``tokenizer`` if it can be saved, else None (a tokenizer that cannot be saved is reloaded from
    model.tokenizer)."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
    except (AttributeError, NotImplementedError, TypeError, ValueError, OSError):
        return None
    return tokenizer


def _write_base(model, tokenizer, routing: list[Path], tmp: Path) -> None:
    """The base row's export: the model as loaded, its tokenizer, the routing files of its source (the base row
    under the model's own routing, as task=evaluate of that source would) and a manifest naming it the base."""
    model.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    for path in routing:
        shutil.copy2(path, tmp / path.name)
    atomic_write_json(tmp / MANIFEST_FILE, {"method": "none", "expert_removal": "base (unpruned)",
                                            "source": str(model.config.name_or_path or "")}, indent=1)


__all__ = ["SCORE_LABELS", "expert_removal_task", "plan"]
