"""The run behind task=evaluate (and the evaluation of task=expert_removal's points): score a model on an
``eval=`` group and write the papers' results table.

The model is ``task.checkpoint`` (an export directory, or a ``.ckpt`` written by task=finetune) or, when
that is null, ``cfg.model`` itself. Generative sets are prompted like training data (``build_prompt``:
Alpaca, or the chat template); ESFT prompts are used verbatim. Predictions go to
``<output_dir>/predictions/<set>.jsonl`` batch by batch, in the format ``python -m moe_lab.eval.score``
reads; a re-run with the same output directory skips the rows already there (and refuses to mix in
predictions made with other settings). The run directory gets ``results.csv``, ``results.md`` and
``summary.json``; loggers get ``eval/<set>/<metric>`` and, for W&B, the table.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..core.atomic import atomic_write_json
from ..core.export_check import check_export
from ..core.method_class import module_fact
from ..core.plain import to_plain
from ..core.stamped_log import RecordLog
from ..data.prompts import build_prompt
from ..eval.choices import choice_item, get_format
from ..eval.eval_sets import (
    GROUPS,
    EvalData,
    EvalSetUnavailable,
    load_eval_set,
    resolve,
    row_ids,
)
from ..eval.fingerprint import model_fingerprint, rows_fingerprint
from ..eval.results import ResultsTable
from ..eval.score import format_summary, score_choice_records, score_predictions
from ..methods.registry import install_exported_routing
from ..models import load_model

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# The model under evaluation


def _run_config(run_dir: Path):
    path = run_dir / "config.yaml"
    return OmegaConf.load(path) if path.is_file() else None


def load_for_eval(cfg: DictConfig):
    """``(model, tokenizer, (model_label, method_label))`` for ``task.checkpoint`` (see module docstring).

    Labels come from ``task.model_label``/``task.method_label``, else from the config.yaml of the run that
    wrote the checkpoint, else ``model.name`` and ``"base"`` (no checkpoint) / the directory name.
    """
    ckpt = cfg.task.get("checkpoint")
    model_cfg = to_plain(cfg.model)
    if ckpt is None:
        model, tokenizer = load_model(model_cfg)
        labels = (model_cfg["name"], "base")
    else:
        path = Path(str(ckpt)).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"task.checkpoint={ckpt}: no such file or directory (an export directory "
                                    "or a .ckpt from task=finetune)")
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"task.checkpoint={ckpt} has no config.json: not a model directory "
                                 "(AutoModelForCausalLM.from_pretrained must load it)")
            check_export(path, "task.checkpoint")
            run = _run_config(path.parent)
            has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
            try:  # the run's method decides whether a dense export (method=kd, task=moe_to_dense) loads
                model, tokenizer = load_model({
                    "pretrained": str(path), "dtype": model_cfg.get("dtype"),
                    "tokenizer": str(path) if has_tokenizer else model_cfg.get("tokenizer"),
                }, method=run.method.name if run is not None else None,
                    dense=run is not None and module_fact(run.method, "trains_dense_models", False))
            except ValueError as err:
                if run is not None or "dense causal LM" not in str(err):
                    raise
                raise ValueError(f"{err}. task.checkpoint={ckpt}: the method comes from the config.yaml of the run "
                                 f"that wrote the export, and {path.parent / 'config.yaml'} does not exist") from None
            labels = (run.model.name, run.method.name) if run is not None else (path.name, "export")
            install_exported_routing(model, path)  # condenser biases, compressed-experts vectors
        else:
            model, tokenizer, labels = _load_lightning_checkpoint(path, model_cfg)
    labels = (cfg.task.get("model_label") or labels[0], cfg.task.get("method_label") or labels[1])
    return model, tokenizer, labels


def _load_lightning_checkpoint(path: Path, model_cfg: dict):
    """A task=finetune ``.ckpt``: the model of its run's config (else ``cfg.model``) with the method installed,
    so methods whose routing vanilla HF cannot express are evaluated with moe-lab's routing."""
    from ..methods.registry import apply

    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if "state_dict" not in checkpoint or "hyper_parameters" not in checkpoint:
        raise ValueError(f"task.checkpoint={path} is not a Lightning checkpoint written by task=finetune")
    run = _run_config(path.parent.parent)
    model, tokenizer = load_model(run.model if run is not None else model_cfg)
    hparams = checkpoint["hyper_parameters"]
    method, options = hparams["method"], dict(hparams.get("options") or {})
    if method == "esft" and "experts" not in options:
        method, options = "sft", {}  # ESFT routes conventionally; its expert selection only matters in training
    apply(model, method, lora=hparams.get("lora") or None, **options)
    state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(state, strict=True)
    model_name = run.model.name if run is not None else model_cfg["name"]
    return model, tokenizer, (model_name, hparams.get("name") or hparams["method"])


# ----------------------------------------------------------------------------------------------------
# Predictions written incrementally, resumed by id


def prediction_mismatch(path: Path, changed: list[str], detail: str) -> str:
    """The refusal of a predictions file written with other settings (a :class:`RecordLog` ``explain``): another
    model (the weights fingerprint differs), other contents of the set (the data fingerprint) or other settings."""
    what = ("with another model (its weights changed since: the fingerprint differs; see "
            "moe_lab.eval.fingerprint)" if "weights" in changed else
            "for other contents of the set (its rows changed since under the same name: the data "
            "fingerprint differs; the predictions would be scored against other answers)"
            if "data" in changed else "with other settings")
    return (f"{path} was written {what} ({detail}). Evaluate into a new output "
            "directory (hydra.run.dir=...) or delete that file to start it over.")


# ----------------------------------------------------------------------------------------------------
# One set


def _prompt(tokenizer, row: dict) -> str:
    """ESFT rows carry their own ``prompt``; the others are formatted like training data."""
    if "prompt" in row and "instruction" not in row:
        return row["prompt"]
    return build_prompt(tokenizer, row)


def _generate_set(model, tokenizer, data: EvalData, ev, store: RecordLog) -> dict[int, object]:
    """Generate the rows ``store`` lacks (``ev.batch_size`` prompts per write); ``{row index: prediction}``."""
    from ..eval.generation import generate

    gen = to_plain(ev.generation)
    ids = row_ids(data)
    done = store.load()
    todo = [k for k, rid in enumerate(ids) if str(rid) not in done]
    if len(todo) < len(ids):
        log.info("%s: %d of %d rows already predicted in %s", data.spec.name, len(ids) - len(todo), len(ids),
                 store.path)
    step = int(ev.batch_size)
    for start in range(0, len(todo), step):
        chunk = todo[start:start + step]
        prompts = [_prompt(tokenizer, data.rows[k]) for k in chunk]
        outputs = generate(model, tokenizer, prompts, batch_size=int(ev.batch_size), **gen)
        records = [{"id": ids[k], "prediction": out[0] if len(out) == 1 else out}
                   for k, out in zip(chunk, outputs)]
        store.append(records)
        done.update({str(r["id"]): r for r in records})
    return {k: done[str(rid)]["prediction"] for k, rid in enumerate(ids)}


def _loglik_set(model, tokenizer, data: EvalData, ev, store: RecordLog) -> dict[int, dict]:
    """Multiple-choice log-likelihood records ``{row index: {"loglik", "pred", "pred_norm"}}``, resumable."""
    from ..eval.likelihood import score_choices

    fmt = get_format(data.spec.answer_format)
    ids = row_ids(data)
    done = store.load()
    todo = []
    for k, rid in enumerate(ids):
        if str(rid) in done:
            continue
        row = data.rows[k]
        try:
            item = choice_item(fmt, row["instruction"], str(row.get("answer")))
        except (ValueError, KeyError):
            continue  # named as bad_gold by the scorer
        todo.append((k, item))
    step = int(ev.batch_size)
    for start in range(0, len(todo), step):
        chunk = todo[start:start + step]
        scored = score_choices(model, tokenizer, [it.context for _, it in chunk], [it.choices for _, it in chunk],
                               batch_size=int(ev.batch_size))
        records = [{"id": ids[k], "loglik": s["loglik"], "pred": s["pred"], "pred_norm": s["pred_norm"]}
                   for (k, _), s in zip(chunk, scored)]
        store.append(records)
        done.update({str(r["id"]): r for r in records})
    return {k: done[str(rid)] for k, rid in enumerate(ids) if str(rid) in done}


def _perplexity_set(model, tokenizer, data: EvalData, ev, pred_dir: Path, settings: dict) -> dict:
    from ..eval.likelihood import max_model_length
    from ..eval.perplexity import perplexity

    cfg = to_plain(ev.perplexity)
    max_length = int(cfg["max_length"])
    limit = max_model_length(model)
    if limit is not None and max_length > limit:
        log.warning("eval.perplexity.max_length=%d is above the model's %d positions: using %d", max_length,
                    limit, limit)
        max_length = limit
    stride = min(int(cfg["stride"]), max_length)
    text = data.text
    if ev.get("limit") is not None:  # the first `limit` non-empty lines (WikiText rows are lines)
        text = "\n".join([line for line in text.split("\n") if line.strip()][: int(ev.limit)])
    settings = {**settings, "max_length": max_length, "stride": stride, "limit": ev.get("limit")}
    cache = pred_dir / f"{data.spec.name}.ppl.json"
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("settings") == json.loads(json.dumps(settings)):
            return saved["summary"]
    result = perplexity(model, tokenizer, text, max_length=max_length, stride=stride)
    summary = {"dataset": data.spec.name, "metric": "ppl", "value": float(result["ppl"]),
               "nll": float(result["nll"]), "tokens": int(result["tokens"]), "max_length": max_length,
               "stride": stride, "complete": ev.get("limit") is None, "bad_gold": []}
    pred_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cache, {"settings": settings, "summary": summary})
    return summary


# ----------------------------------------------------------------------------------------------------
# The task


def _load_sets(specs, ev, seed: int) -> tuple[list[tuple], dict[str, str]]:
    """Read every set before the model is loaded (a missing set fails fast); ``([(spec, data)], skipped)``."""
    paths = to_plain(ev.get("paths")) or {}
    loaded, skipped = [], {}
    for spec in specs:
        try:
            data = load_eval_set(spec, ev.get("data_dir"), paths.get(spec.name), seed=seed)
        except (EvalSetUnavailable, FileNotFoundError) as err:
            if ev.on_unavailable == "error":
                raise
            skipped[spec.name] = str(err)
            print(f"{spec.name}: skipped ({err})", flush=True)
            loaded.append((spec, None))
            continue
        loaded.append((spec, data))
    return loaded, skipped


def _evaluate_set(model, tokenizer, data: EvalData, ev, pred_dir: Path, settings: dict, cells: list) -> dict:
    """One set's summary; appends its ``(column, value, averaged)`` table cells to ``cells``."""
    spec = data.spec
    if spec.kind == "perplexity":
        summary = _perplexity_set(model, tokenizer, data, ev, pred_dir, settings)
        cells.append((spec.title, summary["value"], False))
        return summary
    store = RecordLog(pred_dir, spec.name, {**settings, "generation": to_plain(ev.generation)},
                      explain=prediction_mismatch)
    predictions = _generate_set(model, tokenizer, data, ev, store)
    summary, per_item = score_predictions(spec, predictions, data=data, mode=ev.extraction)
    _write_jsonl(pred_dir / f"{spec.name}.scored.jsonl", per_item)
    cells.append((spec.title, _percent(summary["value"]), True))
    if spec.kind == "commonsense" and ev.get("loglik"):
        mc_store = RecordLog(pred_dir, f"{spec.name}.mc", {**settings, "kind": "loglik"},
                             explain=prediction_mismatch)
        mc = score_choice_records(data, _loglik_set(model, tokenizer, data, ev, mc_store))
        summary["loglik"] = mc
        cells.append((f"{spec.title} acc (ll)", _percent(mc["value"]), False))
        cells.append((f"{spec.title} acc_norm (ll)", _percent(mc["acc_norm"]), False))
    return summary


def evaluate(cfg: DictConfig) -> dict:
    """Evaluate on ``cfg.eval``; write predictions, results.csv/.md and summary.json; return flat metrics."""
    ev = cfg.get("eval")
    lm_columns = _lm_columns(cfg)
    if ev is None or not (ev.get("datasets") or lm_columns):
        raise ValueError(f"task=evaluate needs an evaluation group: eval={' | eval='.join(GROUPS)} "
                         "(or lm-eval tasks: eval.lm_eval.tasks)")
    if ev.on_unavailable not in ("skip", "error"):
        raise ValueError(f"eval.on_unavailable={ev.on_unavailable!r}: choose skip or error")
    start = time.time()
    loaded, skipped = _load_sets(resolve(list(ev.datasets)), ev, int(cfg.seed))
    if loaded and all(data is None for _, data in loaded):
        raise FileNotFoundError(
            f"eval={ev.get('name')}: nothing to evaluate, every set was skipped ({'; '.join(skipped.values())}). "
            "Point each set at a local file with eval.paths.<set>=/local/file (or eval.data_dir=...)"
        )
    out = Path(cfg.paths.output_dir)
    pred_dir = out / "predictions"
    torch.manual_seed(int(cfg.seed))
    model, tokenizer, key = load_for_eval(cfg)
    model.to(ev.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
    settings = {"checkpoint": None if cfg.task.get("checkpoint") is None else str(cfg.task.checkpoint),
                "model": key[0], "method": key[1],
                "weights": model_fingerprint(cfg.task.get("checkpoint"), to_plain(cfg.model))}
    table = ResultsTable()
    results: dict[str, dict] = {}
    for spec, data in loaded:
        if data is None:
            table.add(*key, spec.title, None, averaged=spec.kind != "perplexity")
            continue
        n_total = len(data.rows)
        set_settings = {**settings, "data": rows_fingerprint(data.rows, data.text)}  # the whole set, any limit
        if ev.get("limit") is not None:
            data = EvalData(data.spec, data.rows[: int(ev.limit)], data.source, text=data.text)
        t0, cells = time.time(), []
        summary = _evaluate_set(model, tokenizer, data, ev, pred_dir, set_settings, cells)
        for column, value, averaged in cells:
            table.add(*key, column, value, averaged=averaged)
        summary.update(n_total_rows=n_total, wall_time_s=round(time.time() - t0, 2))
        results[spec.name] = summary
        print(format_summary(summary) if spec.kind != "perplexity" else
              f"{spec.name}: ppl = {summary['value']:.4f} ({summary['tokens']} tokens)", flush=True)
        for problem in summary.get("bad_gold", []):
            print(f"  warning: bad gold answer, row not scored: {problem}", flush=True)
    if lm_columns:
        _lm_eval_columns(model, tokenizer, ev, lm_columns, key, table, results)
    return _write_outputs(cfg, out, table, results, skipped, key, time.time() - start)


def _lm_columns(cfg: DictConfig) -> dict:
    """``eval.lm_eval.tasks`` checked: ``{column: {"task": str, "metric": str}}`` (empty when unset)."""
    columns = to_plain(OmegaConf.select(cfg, "eval.lm_eval.tasks")) or {}
    for column, spec in columns.items():
        if not isinstance(spec, dict) or set(spec) != {"task", "metric"}:
            raise ValueError(f"eval.lm_eval.tasks.{column} must be {{task: <lm-eval task>, metric: <result key>}}, "
                             f"got {spec!r}")
    return columns


def _lm_eval_columns(model, tokenizer, ev, columns: dict, key, table: ResultsTable, results: dict) -> None:
    """``eval.lm_eval.tasks`` ({column: {task, metric}}) through lm-evaluation-harness, one table column each."""
    from ..eval.lm_eval_bridge import evaluate_with_lm_eval, lm_eval_metrics

    lm, t0 = ev.lm_eval, time.time()
    extra = {"confirm_run_unsafe_code": True} if lm.get("confirm_run_unsafe_code") else {}
    tasks = list(dict.fromkeys(spec["task"] for spec in columns.values()))
    metrics = lm_eval_metrics(evaluate_with_lm_eval(
        model, tokenizer, tasks, limit=ev.get("limit"), batch_size=int(ev.batch_size), data_dir=ev.get("data_dir"),
        num_fewshot=lm.get("num_fewshot"), hub_tasks=bool(lm.hub_tasks), **extra))
    for column, spec in columns.items():
        reported = metrics.get(spec["task"], {})
        if spec["metric"] not in reported:
            raise KeyError(f"eval.lm_eval.tasks.{column}: lm-eval reported no {spec['metric']!r} for "
                           f"{spec['task']}; it reported {sorted(reported)}")
        value = float(reported[spec["metric"]])
        table.add(*key, column, _percent(value), averaged=True)
        results[spec["task"] if spec["task"] not in results else f"{spec['task']}[{column}]"] = {
            "dataset": spec["task"], "metric": spec["metric"].replace(",", "/"), "value": value, "column": column,
            "complete": ev.get("limit") is None, "wall_time_s": round(time.time() - t0, 2)}
        print(f"{column}: {spec['task']} {spec['metric']} = {100.0 * value:.2f}", flush=True)


def _percent(value):
    return None if value is None else 100.0 * value


def _write_jsonl(path: Path, items: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(item, ensure_ascii=False) + "\n" for item in items)


def _flat_metrics(results: dict[str, dict], table: ResultsTable, key) -> dict[str, float]:
    metrics = {}
    for name, s in results.items():
        if s["value"] is not None:
            metrics[f"eval/{name}/{s['metric']}"] = float(s["value"])
        if "loglik" in s and s["loglik"]["value"] is not None:
            metrics[f"eval/{name}/ll_acc"] = float(s["loglik"]["value"])
            metrics[f"eval/{name}/ll_acc_norm"] = float(s["loglik"]["acc_norm"])
    avg, _ = table.average(key) if key in table.cells else (None, 0)
    if avg is not None:
        metrics["eval/avg"] = avg / 100.0
    return metrics


def _write_outputs(cfg, out: Path, table: ResultsTable, results, skipped, key, wall: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    table.write_csv(out / "results.csv")
    table.write_markdown(out / "results.md")
    metrics = _flat_metrics(results, table, key)
    summary = {
        "model": key[0], "method": key[1], "eval": cfg.eval.get("name"),
        "checkpoint": None if cfg.task.get("checkpoint") is None else str(cfg.task.checkpoint),
        "limit": cfg.eval.get("limit"), "extraction": cfg.eval.extraction, "metrics": metrics,
        "datasets": results, "skipped": skipped, "columns": table.columns, "table": table.to_json(),
        "wall_time_s": round(wall, 1),
    }
    atomic_write_json(out / "summary.json", summary, indent=2, ensure_ascii=False)
    loggers = [instantiate(node) for node in (cfg.get("logger") or {}).values() if node is not None]
    with warnings.catch_warnings():  # the CSV logger shares the run directory with our outputs on purpose
        warnings.filterwarnings("ignore", message="Experiment logs directory")
        for logger in loggers:
            logger.log_metrics(metrics, step=0)
            logger.save()
    table.log_wandb(loggers)
    for logger in loggers:
        logger.finalize("success")
    if cfg.eval.get("limit") is not None:
        print(f"eval.limit={cfg.eval.limit}: scores are on the first {cfg.eval.limit} rows of each set only")
    print(table.to_markdown(), end="", flush=True)
    return metrics
