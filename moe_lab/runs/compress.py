"""The run behind task=compress (and the conversion stage of task=moe_to_dense): MoE -> dense conversion or expert
pruning from one calibration file, perplexity, export; ``compress.sweep=true`` evaluates a whole grid in one process
(see ``moe_lab.runs.compress_sweep``)."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from omegaconf import DictConfig

from ..compress.calibration import Calibration
from ..compress.dense import export_compressed, to_dense
from ..compress.prune import prune_experts, strategy_counts
from ..core.atomic import atomic_write_json
from ..core.plain import to_plain
from ..core.stamped_log import PointLog
from ..data.collate import encode_prompt
from ..eval.eval_sets import load_eval_set
from ..models import load_model
from ..moe.view import find_moe_layers
from ..runtime.stop_signal import StopOnSignal
from .compress_sweep import (
    BEST_PPL,
    choose_scaling,
    dense_sweep,
    grid_markdown,
    grid_table,
    ppl_point,
    prune_study,
    write_grid,
    write_prune_study,
)

log = logging.getLogger(__name__)


def eval_ids(ev, tokenizer) -> list[int]:
    """Token ids of the perplexity text (WikiText-2 test, or ``compress.eval.path``), capped at max_tokens."""
    data = load_eval_set("wikitext2", path=ev.path)
    ids = encode_prompt(tokenizer, data.text)
    return ids[: int(ev.max_tokens)] if ev.max_tokens else ids


def student_ppl(model, tokenizer, c: DictConfig) -> dict:
    """``ppl_point`` of ``model`` on ``compress.eval`` (``c``), at the settings task=compress measures with."""
    kw = {"max_length": min(int(c.eval.max_length), int(model.config.max_position_embeddings)),
          "stride": int(c.eval.stride), "batch_size": int(c.eval.batch_size)}
    kw["stride"] = min(kw["stride"], kw["max_length"])
    return ppl_point(model.eval(), tokenizer, eval_ids(c.eval, tokenizer), **kw)


def _check(c) -> None:
    if c.method not in ("to_dense", "prune"):
        raise ValueError(f"compress.method={c.method!r}: choose to_dense or prune (compress=prune)")
    if c.linkage != "average":
        raise ValueError(f"compress.linkage={c.linkage!r}: only average linkage is implemented (the spec's choice)")
    if not c.pad_dense_layers:
        raise ValueError("compress.pad_dense_layers=false: per-layer widths are not supported; the teacher's dense "
                         "layers are zero-padded to the student width (set it to true)")


def _lam(c):
    value = c.do["lambda"]
    return value if value in (None, "auto") else float(value)


def _calibration(c, required: bool) -> Calibration | None:
    if c.calibration_file:
        return Calibration.load(c.calibration_file, field="compress.calibration_file")
    if required:
        raise ValueError("compress.calibration_file is not set: run task=calibrate first and pass "
                         "compress.calibration_file=<its run dir>/calibration.safetensors")
    return None


def compress(cfg: DictConfig) -> dict:
    """Run ``cfg.compress`` on ``cfg.model``; writes summary.json (and the grid / plot / export)."""
    c = cfg.compress
    _check(c)
    out = Path(cfg.paths.output_dir)
    start = time.time()
    model, tokenizer = load_model(cfg.model)
    model.eval()
    ids = eval_ids(c.eval, tokenizer)
    ppl_kw = {"max_length": min(int(c.eval.max_length), int(model.config.max_position_embeddings)),
              "stride": int(c.eval.stride), "batch_size": int(c.eval.batch_size)}
    ppl_kw["stride"] = min(ppl_kw["stride"], ppl_kw["max_length"])
    summary = {"method": c.method, "eval_tokens": len(ids), **ppl_kw}
    if c.method == "to_dense":
        calibration = _calibration(c, required=True)
        if c.sweep:
            summary.update(_dense_grid(model, tokenizer, calibration, ids, c, ppl_kw, out, _study_settings(cfg, ppl_kw)))
        else:
            scaling = c.scaling
            if scaling == BEST_PPL:  # the paper's Stage 2: the candidate with the lowest pre-distillation ppl
                scaling, found = choose_scaling(model, tokenizer, calibration, ids, score=c.score,
                                                grouping=c.grouping, K=c.K, candidates=list(c.scaling_candidates),
                                                order=c.do.order, lam=_lam(c), seed=int(c.seed), **ppl_kw)
                summary["scaling_choice"] = {"rule": "lowest pre-distillation ppl", "chosen": scaling,
                                             "candidates": found}
            student = to_dense(model, calibration, score=c.score, grouping=c.grouping, scaling=scaling,
                               K=c.K, order=c.do.order, lam=_lam(c), seed=int(c.seed))
            summary.update(_single(student, tokenizer, ids, ppl_kw, c, out))
    else:
        p = c.prune
        view = find_moe_layers(model)[0]
        if c.sweep:
            if not p["values"]:
                raise ValueError("compress.sweep=true with compress=prune needs compress.prune.values=[...]")
            needs = p.strategy != "inference_reduce"
            log_ = PointLog(out / "prune.csv", ("strategy", "n_keep", "top_k"),
                            _study_settings(cfg, ppl_kw, prune={k: v for k, v in to_plain(p).items() if k != "values"}))
            with StopOnSignal("the pruning study") as stop:
                points = prune_study(model, tokenizer, _calibration(c, needs), ids, strategy=p.strategy,
                                     values=list(p["values"]), score=p.score, always_keep=to_plain(p.always_keep),
                                     group_balanced=bool(p.group_balanced), progress=log_.append,
                                     done=log_.done(), stop=stop, **ppl_kw)
                if stop():
                    stop.exit(_resume_hint(out, log_))
            files = write_prune_study(points, out)
            summary.update({"points": json.loads(points.to_json(orient="records")),
                            "files": {k: str(v) for k, v in files.items()}})
        else:
            n_keep, k_keep = strategy_counts(p.strategy, view.num_experts, view.top_k, n_keep=p.n_keep,
                                             k_keep=p.top_k)
            pruned = prune_experts(model, _calibration(c, n_keep < view.num_experts), keep=n_keep, top_k=k_keep,
                                   score=p.score, always_keep=to_plain(p.always_keep),
                                   group_balanced=bool(p.group_balanced), seed=int(c.seed))
            summary.update(_single(pruned, tokenizer, ids, ppl_kw, c, out))
    summary["wall_time_s"] = round(time.time() - start, 2)
    atomic_write_json(out / "summary.json", summary, indent=2, default=str)
    return summary


def _study_settings(cfg: DictConfig, ppl_kw: dict, **extra) -> dict:
    """What a grid's / study's points depend on besides their own key: a re-run with other settings is refused."""
    from ..eval.fingerprint import weights_fingerprint

    c = cfg.compress
    # the file's contents (its header holds the manifest: data sha256, sequences, ...), not only its path: a
    # calibration rewritten at the same path would mix old points with new ones
    contents = weights_fingerprint(c.calibration_file) if c.calibration_file else None
    return {"model": to_plain(cfg.model), "calibration_file": c.calibration_file, "calibration_contents": contents,
            "eval": to_plain(c.eval),
            "seed": int(c.seed), "order": c.do.order, "lambda": _lam(c), **ppl_kw, **extra}


def _resume_hint(out: Path, points_log: PointLog) -> str:
    return (f"{len(points_log.rows)} finished points are in {points_log.path}. Resume with: the same command and "
            f"hydra.run.dir={out}, or python run.py task.resume={out} (finished points are skipped)")


def _single(model, tokenizer, ids, ppl_kw, c, out: Path) -> dict:
    point = ppl_point(model, tokenizer, ids, **ppl_kw)
    print(f"==== moe-lab compress ({c.method}): ppl {point['ppl']:.4g} ({point['status']})", flush=True)
    result = {"ppl": point["ppl"], "status": point["status"], "manifest": model.moe_lab_manifest}
    if c.export:
        result["export"] = str(export_compressed(model, out / "export", tokenizer))
    return result


def _dense_grid(model, tokenizer, calibration, ids, c, ppl_kw, out: Path, settings: dict) -> dict:
    g = c.grid
    total = len(g.scores) * len(g.groupings) * len(g.scalings)
    points_log = PointLog(out / "points.csv", ("score", "grouping", "scaling", "K"), settings)
    if points_log.rows:
        print(f"==== moe-lab compress: {len(points_log.rows)} points already in {points_log.path}: skipped",
              flush=True)

    def progress(point: dict) -> None:
        points_log.append(point)
        log.info("sweep point %d: %s/%s/%s K=%d ppl %.4g (%s)", len(points_log.rows), point["score"],
                 point["grouping"], point["scaling"], point["K"], point["ppl"], point["status"])

    with StopOnSignal("the grid") as stop:
        points = dense_sweep(model, tokenizer, calibration, ids, scores=list(g.scores), groupings=list(g.groupings),
                             scalings=list(g.scalings), Ks=None if g.K is None else [int(K) for K in g.K],
                             order=c.do.order, lam=_lam(c), seed=int(c.seed), progress=progress,
                             done=points_log.done(), stop=stop, **ppl_kw)
        if stop():
            stop.exit(_resume_hint(out, points_log))
    files = write_grid(points, out, title=f"{model.config.model_type} pre-distillation perplexity")
    table = grid_table(points)
    print(grid_markdown(table), flush=True)
    # Stage 2 choice per (score, grouping): the (K, scaling) with the lowest pre-distillation ppl
    chosen = {}
    for (s, gr, sc), row in table.iterrows():
        key = f"{s}/{gr}"
        if not math.isnan(row.best_ppl) and (key not in chosen or row.best_ppl < chosen[key]["ppl"]):
            chosen[key] = {"scaling": sc, "K": int(row.best_K), "ppl": float(row.best_ppl)}
    failed = int((points.status != "ok").sum())
    return {"points": len(points), "failed_points": failed, "rows": total, "best_per_pair": chosen,
            "sweep_seconds": round(float(points.seconds.sum()), 2), "files": {k: str(v) for k, v in files.items()}}
