"""Score generated predictions against an evaluation set; ``python -m moe_lab.eval.score`` for external ones.

A predictions file is JSON lines ``{"id": <row index, or the row's own id>, "prediction": "<text>"}``
(``"prediction"`` may be a list of samples: the item scores the mean over them, pass@1). Every problem is
reported, never averaged away: a malformed line, a missing / duplicate / unknown id is an error naming the
line; an empty generation is status ``empty`` (wrong); a gold answer that is missing or unusable is status
``bad_gold`` naming the row (left out of the accuracy and listed); rows without a prediction are counted
in ``coverage``.

Per-item statuses: ``correct``, ``wrong``, ``no_answer`` (nothing extractable: wrong), ``empty`` (wrong),
``bad_gold`` (not scored), ``scored`` (similarity metrics: the value is in ``score``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable, Mapping

from .answers import (
    extract_choice_letter,
    extract_final_answer,
    extract_letter,
    extract_number,
    math_equal,
    numbers_match,
    parse_gold_number,
)
from .choices import choice_item, get_format
from .eval_sets import EvalData, EvalSet, get_eval_set, load_eval_set, row_ids


class PredictionsError(ValueError):
    """A predictions file or list that cannot be scored as it is."""


# ----------------------------------------------------------------------------------------------------
# One generation against one gold answer


def _outcome(status: str, extracted=None, score: float | None = None) -> dict:
    if score is None:
        score = 1.0 if status == "correct" else 0.0
    return {"status": status, "extracted": extracted, "score": score}


def score_text(spec: EvalSet, gold, text: str, mode: str = "answer_is") -> dict:
    """``{"status", "extracted", "score"}`` of one generation; ``gold`` must already be valid (see ``check_gold``)."""
    if not isinstance(text, str):
        raise PredictionsError(f"a prediction must be a string, got {type(text).__name__}")
    if not text.strip():
        return _outcome("empty")
    if spec.kind == "math_numeric":
        pred = extract_number(text, mode)
        if pred is None:
            return _outcome("no_answer")
        return _outcome("correct" if numbers_match(pred, gold) else "wrong", pred)
    if spec.kind in ("math_letter", "choice_letter"):
        pred = extract_letter(text, mode) if spec.kind == "math_letter" else extract_choice_letter(text)
        if pred is None:
            return _outcome("no_answer")
        return _outcome("correct" if pred == gold else "wrong", pred)
    if spec.kind == "commonsense":
        pred = get_format(spec.answer_format).extract(text)
        if pred is None:
            return _outcome("no_answer")
        return _outcome("correct" if pred == gold else "wrong", pred)
    if spec.kind == "boxed":
        pred = extract_final_answer(text)
        if pred is None:
            return _outcome("no_answer")
        return _outcome("correct" if math_equal(pred, gold) else "wrong", pred)
    if spec.kind == "esft_intent":
        pred = intent_prediction(text)
        if pred is None:
            return _outcome("no_answer")
        return _outcome("correct" if intent_match(pred, gold) else "wrong", pred)
    if spec.kind == "esft_reference":
        pred = reference_prediction(text, first_paragraph=spec.name == "esft_translation")
        return _outcome("scored", pred, rouge_l(pred, gold))
    raise ValueError(f"evaluation set {spec.name!r} (kind {spec.kind}) is not scored from generated text")


def check_gold(spec: EvalSet, row: Mapping):
    """The usable gold answer of a row, or raise ``ValueError`` saying what is wrong with it."""
    gold = row.get("answer")
    if gold is None or (isinstance(gold, str) and not gold.strip()):
        raise ValueError("the row has no 'answer'")
    if spec.kind == "math_numeric":
        return parse_gold_number(gold)
    gold = str(gold).strip()
    if spec.kind == "math_letter" and gold not in tuple("ABCDE"):
        raise ValueError(f"gold answer {gold!r} is not a letter A-E")
    if spec.kind == "choice_letter" and gold not in tuple("ABCD"):
        raise ValueError(f"gold answer {gold!r} is not a letter A-D")
    if spec.kind == "commonsense":
        labels = get_format(spec.answer_format).labels
        if gold not in labels:
            raise ValueError(f"gold answer {gold!r} is not one of {'/'.join(labels)}")
    if spec.kind == "esft_intent":
        try:
            parsed = json.loads(gold)
        except json.JSONDecodeError:
            raise ValueError(f"gold answer {gold!r} is not JSON") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"gold answer {gold!r} is not a JSON object")
        return parsed
    return gold


# ----------------------------------------------------------------------------------------------------
# ESFT domain tasks (ESFT's benchmarks.py post-processing; see eval_sets for what is scored how)


def intent_prediction(text: str) -> dict | None:
    """ESFT's intent post-processing: a ```json block if any, else the first non-empty line, parsed as JSON."""
    pred = text.strip().strip(".。")
    if "```json" in pred:
        pred = pred[pred.index("```json") + 7:]
        pred = pred[: pred.index("```")] if "```" in pred else pred
    lines = [line for line in pred.split("\n") if line.strip()]
    pred = (lines[0] if lines else "").strip().strip(".。")
    try:
        parsed = json.loads(pred)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _slots(slots, strip_spaces: bool) -> set | None:
    if not isinstance(slots, dict):
        return None
    out = set()
    for key, value in slots.items():
        if isinstance(value, list):
            items = sorted(str(v).replace(" ", "") if strip_spaces else str(v) for v in value)
            out.add((key, str(tuple(items))))
        else:
            out.add((key, str(value).replace(" ", "") if strip_spaces else str(value)))
    return out


def intent_match(pred: dict, gold: dict) -> bool:
    """ESFT's intent metric: the intent and the whole slot set equal the reference's."""
    pred_slots, gold_slots = _slots(pred.get("slots", {}), True), _slots(gold.get("slots", {}), False)
    return pred.get("intent", "") == gold.get("intent", "") and pred_slots is not None and pred_slots == gold_slots


def reference_prediction(text: str, first_paragraph: bool = False) -> str:
    """ESFT's post-processing for judged tasks: stripped; translation keeps the first paragraph."""
    pred = text.strip()
    return pred.split("\n\n")[0] if first_paragraph else pred


_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_TOKEN = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+")


def rouge_l(pred: str, reference: str) -> float:
    """ROUGE-L F1 on tokens: each CJK character is a token, other words are tokens (case-folded)."""
    a, b = _TOKEN.findall(pred.lower()), _TOKEN.findall(str(reference).lower())
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


# ----------------------------------------------------------------------------------------------------
# Predictions files and whole sets


def read_predictions(path, ids: list) -> dict[int, object]:
    """``{row index: prediction}`` from a JSON-lines file; errors name the line (see module docstring)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PredictionsError(f"{path}: line {n} is not valid JSON ({err.msg})") from None
            records.append((f"{path}: line {n}", record))
    return index_predictions(records, ids)


def index_predictions(records: Iterable, ids: list) -> dict[int, object]:
    """Map ``(where, {"id", "prediction"})`` records (or plain dicts) to ``{row index: prediction}``."""
    own_ids = ids != list(range(len(ids)))
    position = {str(i): k for k, i in enumerate(ids)}
    out: dict[int, object] = {}
    first_seen: dict[int, str] = {}
    for n, item in enumerate(records):
        where, record = item if isinstance(item, tuple) else (f"prediction {n}", item)
        if not isinstance(record, dict):
            raise PredictionsError(f"{where}: expected an object with 'id' and 'prediction'")
        if "id" not in record:
            raise PredictionsError(f"{where}: missing 'id' (the row index in the dataset file, or its own id)")
        if "prediction" not in record:
            raise PredictionsError(f"{where}: missing 'prediction' (the generated text)")
        rid = record["id"]
        if own_ids:
            k = position.get(str(rid))
            if k is None:
                raise PredictionsError(f"{where}: id {rid!r} is not the id of any row of the dataset")
        else:
            if isinstance(rid, bool) or not isinstance(rid, int):
                raise PredictionsError(f"{where}: id {rid!r} must be an integer row index 0..{len(ids) - 1}")
            if not 0 <= rid < len(ids):
                raise PredictionsError(f"{where}: id {rid} is out of range: the dataset has {len(ids)} rows "
                                       f"(ids 0..{len(ids) - 1})")
            k = rid
        if k in out:
            raise PredictionsError(f"{where}: duplicate id {rid!r} (first given at {first_seen[k]})")
        pred = record["prediction"]
        samples = pred if isinstance(pred, list) else [pred]
        if not samples or not all(isinstance(s, str) for s in samples):
            raise PredictionsError(f"{where}: 'prediction' must be a string or a non-empty list of strings")
        out[k], first_seen[k] = pred, where
    return out


def _score_row(spec: EvalSet, data: EvalData, k: int, rid, pred, mode: str) -> dict:
    row = data.rows[k]
    item = {"id": rid, "index": k}
    try:
        gold = check_gold(spec, row)
    except ValueError as err:
        return {**item, "status": "bad_gold", "gold": row.get("answer"), "score": None,
                "error": f"{data.where(k)}: {err}"}
    item["gold"] = row.get("answer")
    samples = pred if isinstance(pred, list) else [pred]
    outcomes = [score_text(spec, gold, text, mode) for text in samples]
    if len(outcomes) == 1:
        return {**item, **outcomes[0]}
    score = sum(o["score"] for o in outcomes) / len(outcomes)
    return {**item, "status": "sampled", "score": score, "samples": outcomes}


def score_predictions(dataset, predictions, *, data_dir=None, path=None, mode: str = "answer_is",
                      data: EvalData | None = None, limit: int | None = None) -> tuple[dict, list[dict]]:
    """Score ``predictions`` on ``dataset`` (a set name or :class:`EvalSet`).

    ``predictions``: a predictions-file path, a list of ``{"id", "prediction"}`` records, or a
    ``{row index: prediction}`` dict. ``data`` (already loaded rows) or ``data_dir``/``path`` say where the
    rows are; ``limit`` restricts the set to its first rows. Returns ``(summary, per_item)``: the summary has
    the metric value over scored rows, status counts, coverage and the named ``bad_gold`` rows; ``per_item``
    has one dict per predicted row (id, status, extracted answer, gold, score).
    """
    spec = get_eval_set(dataset) if isinstance(dataset, str) else dataset
    data = data or load_eval_set(spec, data_dir, path)
    if limit is not None:
        data = EvalData(data.spec, data.rows[:limit], data.source)
    ids = row_ids(data)
    if isinstance(predictions, (str, bytes)) or hasattr(predictions, "__fspath__"):
        indexed = read_predictions(predictions, ids)
    elif isinstance(predictions, Mapping):
        indexed = dict(predictions)
    else:
        indexed = index_predictions(predictions, ids)
    per_item = [_score_row(spec, data, k, ids[k], indexed[k], mode) for k in sorted(indexed)]
    return summarize(spec, per_item, len(data.rows)), per_item


def summarize(spec: EvalSet, per_item: list[dict], n_rows: int) -> dict:
    """Metric value (mean ``score`` over rows with a valid gold answer), status counts and coverage."""
    scored = [it for it in per_item if it["status"] != "bad_gold"]
    statuses = Counter(it["status"] for it in per_item if it["status"] != "sampled")
    statuses.update(s["status"] for it in per_item for s in it.get("samples", []))
    value = sum(it["score"] for it in scored) / len(scored) if scored else None
    return {
        "dataset": spec.name,
        "metric": spec.metric,
        "value": value,
        "n_rows": n_rows,
        "n_predicted": len(per_item),
        "n_scored": len(scored),
        "n_correct": sum(1 for it in scored if it["status"] == "correct"),
        "coverage": len(per_item) / n_rows if n_rows else 0.0,
        "complete": len(per_item) == n_rows,
        "statuses": dict(sorted(statuses.items())),
        "bad_gold": [it["error"] for it in per_item if it["status"] == "bad_gold"],
    }


def score_choice_records(data: EvalData, records: Mapping[int, dict]) -> dict:
    """acc / acc_norm of ``{row index: {"pred", "pred_norm"}}`` log-likelihood predictions of a commonsense set."""
    fmt = get_format(data.spec.answer_format)
    correct = correct_norm = 0
    bad = []
    for k, rec in records.items():
        row = data.rows[k]
        try:
            gold = choice_item(fmt, row["instruction"], str(row.get("answer"))).gold
        except (ValueError, KeyError) as err:
            bad.append(f"{data.where(k)}: {err}")
            continue
        correct += rec["pred"] == gold
        correct_norm += rec["pred_norm"] == gold
    n = len(records) - len(bad)
    return {"dataset": data.spec.name, "metric": "acc", "value": correct / n if n else None,
            "acc_norm": correct_norm / n if n else None, "n_rows": len(data.rows), "n_predicted": len(records),
            "n_scored": n, "coverage": len(records) / len(data.rows) if data.rows else 0.0,
            "complete": len(records) == len(data.rows), "bad_gold": bad}


def format_summary(summary: dict) -> str:
    """One line: metric, counts, coverage and the non-correct statuses."""
    value = summary["value"]
    shown = "n/a" if value is None else f"{value:.4f}"
    line = f"{summary['dataset']}: {summary['metric']} = {shown}"
    if summary.get("n_correct") is not None and summary["metric"] in ("acc", "intent_em"):
        line += f" ({summary['n_correct']}/{summary['n_scored']})"
    line += f" | coverage {summary['n_predicted']}/{summary['n_rows']}"
    if not summary["complete"]:
        line += f" ({summary['coverage']:.1%}, PARTIAL: rows without a prediction are not scored)"
    other = {k: v for k, v in summary.get("statuses", {}).items() if k not in ("correct", "wrong", "scored")}
    if other:
        line += " | " + ", ".join(f"{k} {v}" for k, v in other.items())
    if summary["bad_gold"]:
        line += f" | bad_gold {len(summary['bad_gold'])} (not scored)"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_lab.eval.score",
        description="Score predictions made elsewhere: JSON lines {\"id\": row index or own id, "
                    "\"prediction\": text}.",
    )
    parser.add_argument("--dataset", required=True, help="evaluation set name, e.g. gsm8k, aqua, boolq")
    parser.add_argument("--predictions", required=True, help="predictions .jsonl file")
    parser.add_argument("--data-dir", default=None, help="LLM-Adapters data folder (default $MOE_LAB_DATA_DIR "
                                                          "or the packaged copy)")
    parser.add_argument("--path", default=None, help="read the dataset from this local file instead")
    parser.add_argument("--mode", default="answer_is", choices=["answer_is", "llm_adapters"],
                        help="math answer extraction rule (llm_adapters = their last-number / first-letter rule)")
    parser.add_argument("--out", default=None, help="write per-item results (JSON lines) here")
    args = parser.parse_args(argv)
    try:
        summary, per_item = score_predictions(args.dataset, args.predictions, data_dir=args.data_dir,
                                              path=args.path, mode=args.mode)
    except (PredictionsError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for problem in summary["bad_gold"]:
        print(f"warning: bad gold answer, row not scored: {problem}", file=sys.stderr)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(item, ensure_ascii=False) + "\n" for item in per_item)
    print(format_summary(summary))
    print(json.dumps({k: v for k, v in summary.items() if k != "bad_gold"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
