"""``python -m moe_lab.eval.score`` as a user runs it: gold-answer figures, and every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import DATA_DIR, ROOT


def score_cli(*args, check_rc: int | None = 0):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "moe_lab.eval.score", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stdout + proc.stderr
    return proc


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def rows(name):
    return json.loads((DATA_DIR / name).read_text())


def test_output_fields_reproduce_the_pinned_accuracy_and_per_item_file(tmp_path):
    gsm8k = rows("gsm8k.test.json")
    preds = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prediction": r["output"]} for i, r in enumerate(gsm8k)])
    out = tmp_path / "per_item.jsonl"
    proc = score_cli("--dataset", "gsm8k", "--predictions", preds, "--data-dir", DATA_DIR, "--out", out)
    assert "gsm8k: acc = 0.5845 (771/1319) | coverage 1319/1319 | empty 6" in proc.stdout
    items = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(items) == 1319 and sum(it["status"] == "correct" for it in items) == 771
    assert items[0] == {"id": 0, "index": 0, "gold": "576.0", "status": "correct", "extracted": 576.0, "score": 1.0}


def test_gold_answers_score_100_on_aqua_by_alias_and_llm_adapters_mode(tmp_path):
    aqua = rows("AQuA.test.json")
    preds = write_jsonl(tmp_path / "p.jsonl",
                        [{"id": i, "prediction": f"The answer is {r['answer']}"} for i, r in enumerate(aqua)])
    proc = score_cli("--dataset", "AQuA", "--predictions", preds, "--data-dir", DATA_DIR,
                     "--mode", "llm_adapters")
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["value"] == 1.0 and summary["n_correct"] == 254 and summary["complete"]


def test_partial_coverage_is_reported(tmp_path):
    preds = write_jsonl(tmp_path / "p.jsonl", [{"id": 5, "prediction": "the correct answer is true"},
                                               {"id": 0, "prediction": "the correct answer is false"}])
    proc = score_cli("--dataset", "boolq", "--predictions", preds, "--data-dir", DATA_DIR)
    assert "coverage 2/3270 (0.1%, PARTIAL: rows without a prediction are not scored)" in proc.stdout
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["n_predicted"] == 2 and not summary["complete"]


@pytest.mark.parametrize("records,message", [
    ([{"id": 0, "prediction": "4"}, {"prediction": "5"}], "p.jsonl: line 2: missing 'id'"),
    ([{"id": 0, "prediction": "4"}, {"id": 1, "prediction": "5"}, {"id": 0, "prediction": "6"}],
     "p.jsonl: line 3: duplicate id 0 (first given at "),
    ([{"id": 395, "prediction": "4"}], "p.jsonl: line 1: id 395 is out of range: the dataset has 395 rows (ids 0..394)"),
    ([{"id": 0, "prediction": "4"}, "", '{"id": 1, "prediction": "5"'], "p.jsonl: line 3 is not valid JSON"),
])
def test_bad_predictions_file_is_an_error_naming_the_line(tmp_path, records, message):
    preds = write_jsonl(tmp_path / "p.jsonl", records)
    proc = score_cli("--dataset", "addsub", "--predictions", preds, "--data-dir", DATA_DIR, check_rc=2)
    assert message in proc.stderr, proc.stderr
    assert "acc =" not in proc.stdout


@pytest.mark.parametrize("records,message", [
    ([{"id": -1, "prediction": "4"}], "id -1 is out of range"),
    ([{"id": "3", "prediction": "4"}], "id '3' must be an integer row index 0..394"),
    ([{"id": True, "prediction": "4"}], "id True must be an integer row index"),
    ([{"id": 0, "text": "4"}], "p.jsonl: line 1: missing 'prediction'"),
    ([{"id": 0, "prediction": 4}], "p.jsonl: line 1: 'prediction' must be a string"),
    ([{"id": 0, "prediction": []}], "p.jsonl: line 1: 'prediction' must be a string or a non-empty list"),
    (["[1, 2]"], "p.jsonl: line 1: expected an object with 'id' and 'prediction'"),
])
def test_more_bad_records_in_process(tmp_path, capsys, records, message):
    from moe_lab.eval.score import main

    preds = write_jsonl(tmp_path / "p.jsonl", records)
    assert main(["--dataset", "addsub", "--predictions", str(preds), "--data-dir", str(DATA_DIR)]) == 2
    assert message in capsys.readouterr().err


def test_bad_gold_rows_and_empty_generations_are_named_not_averaged(tmp_path):
    data = tmp_path / "custom.json"
    data.write_text(json.dumps([
        {"instruction": "1+1?", "output": "", "answer": "2"},
        {"instruction": "2+2?", "output": ""},
        {"instruction": "3+3?", "output": "", "answer": "six"},
        {"instruction": "4+4?", "output": "", "answer": "8"},
    ], indent=2))
    preds = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prediction": p} for i, p in
                                               enumerate(["The answer is 2", "4", "6", ""])])
    out = tmp_path / "items.jsonl"
    proc = score_cli("--dataset", "gsm8k", "--predictions", preds, "--path", data, "--out", out)
    assert f"warning: bad gold answer, row not scored: {data}: row 1 (line 7): the row has no 'answer'" in proc.stderr
    assert f"{data}: row 2 (line 11): gold answer 'six' is not a number" in proc.stderr
    assert "gsm8k: acc = 0.5000 (1/2) | coverage 4/4 | bad_gold 2, empty 1 | bad_gold 2 (not scored)" in proc.stdout
    statuses = [json.loads(line)["status"] for line in out.read_text().splitlines()]
    assert statuses == ["correct", "bad_gold", "bad_gold", "empty"]


def test_unknown_dataset_and_missing_files(tmp_path):
    preds = write_jsonl(tmp_path / "p.jsonl", [{"id": 0, "prediction": "1"}])
    proc = score_cli("--dataset", "gsm9k", "--predictions", preds, check_rc=2)
    assert "unknown evaluation set 'gsm9k': choose one of gsm8k, svamp" in proc.stderr and "math7" in proc.stderr
    proc = score_cli("--dataset", "gsm8k", "--predictions", preds, "--data-dir", tmp_path, check_rc=2)
    assert f"{tmp_path / 'gsm8k.test.json'} does not exist" in proc.stderr and "eval.paths.gsm8k" in proc.stderr
    proc = score_cli("--dataset", "math500", "--predictions", preds, check_rc=2)
    assert "eval.paths.math500=/local/path" in proc.stderr


# ----------------------------------------------------------------------------------------------------
# Sets without a shared copy: scored from small local files in their own formats


def test_esft_metrics_by_hand():
    from moe_lab.eval.score import intent_match, intent_prediction, rouge_l

    assert rouge_l("the cat sat on the mat", "The cat is on the mat") == pytest.approx(5 / 6)
    assert rouge_l("我喜欢猫", "我喜欢狗") == pytest.approx(0.75)  # one token per CJK character
    assert rouge_l("", "x") == 0.0 and rouge_l("a b", "c d") == 0.0
    gold = {"intent": "Alarm-Update", "slots": {"datetime_date": "今天", "notes": ["b", "a"]}}
    assert intent_match(intent_prediction('{"intent": "Alarm-Update", "slots": {"notes": ["a", "b"], '
                                          '"datetime_date": "今 天"}}。\nmore'), gold)
    fenced = '```json\n{"intent": "Alarm-Update", "slots": {"datetime_date": "今天", "notes": ["a", "b"]}}\n```'
    assert intent_match(intent_prediction(fenced), gold)
    assert not intent_match(intent_prediction('{"intent": "Alarm-Update", "slots": {"notes": ["a", "b"]}}'), gold)
    assert intent_prediction("not json") is None


def test_esft_files_use_their_own_ids(tmp_path):
    gold = '{"intent": "Weather-Query", "slots": {"city": "天津"}}'
    data = write_jsonl(tmp_path / "intent.jsonl", [
        {"idx": 0, "prompt": "User: ...\n\nAssistant:", "raw_answers": [gold], "answers": [gold]},
        {"idx": 2, "prompt": "User: ...\n\nAssistant:", "raw_answers": [gold], "answers": [gold]},
    ])
    preds = write_jsonl(tmp_path / "p.jsonl", [{"id": 2, "prediction": gold}, {"id": 0, "prediction": "{}"}])
    proc = score_cli("--dataset", "esft_intent", "--predictions", preds, "--path", data)
    assert "esft_intent: intent_em = 0.5000 (1/2) | coverage 2/2" in proc.stdout
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": 1, "prediction": gold}])
    from moe_lab.eval.score import PredictionsError, score_predictions

    with pytest.raises(PredictionsError, match="line 1: id 1 is not the id of any row"):
        score_predictions("esft_intent", bad, path=data)


def test_hard_reasoning_pass_at_1_over_samples_and_gpqa_option_order(tmp_path):
    from moe_lab.eval.eval_sets import load_eval_set
    from moe_lab.eval.score import score_predictions

    aime = write_jsonl(tmp_path / "aime.jsonl", [{"id": 60, "problem": "Find x.", "answer": "204"},
                                                 {"id": 61, "problem": "Find y.", "answer": "25"}])
    samples = {60: [r"so \boxed{204}", r"\boxed{205}", "The answer is 204.", ""],
               61: [r"\boxed{25}", r"\boxed{25}", r"\boxed{25}", r"\boxed{\frac{50}{2}}"]}
    summary, items = score_predictions("aime24", [{"id": k, "prediction": v} for k, v in samples.items()],
                                       path=aime)
    assert [it["score"] for it in items] == [0.5, 0.75]  # \frac{50}{2} is not normalised to 25 (as in MATH)
    assert summary["value"] == pytest.approx(0.625) and summary["metric"] == "pass@1"
    assert summary["statuses"] == {"correct": 5, "empty": 1, "wrong": 2}
    data = load_eval_set("aime24", path=aime)
    assert data.rows[0]["instruction"].startswith("Find x.") and data.rows[0]["instruction"].endswith(r"\boxed{}.")
    gpqa = write_jsonl(tmp_path / "gpqa.jsonl", [
        {"Record ID": f"r{i}", "Question": f"Q{i}?", "Correct Answer": "right", "Incorrect Answer 1": "w1",
         "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"} for i in range(6)])
    data = load_eval_set("gpqa_diamond", path=gpqa, seed=0)
    letters = [r["answer"] for r in data.rows]
    for row in data.rows:
        assert f"{row['answer']}) right" in row["instruction"]
    assert len(set(letters)) > 1 and letters == [r["answer"] for r in load_eval_set("gpqa_diamond", path=gpqa).rows]
    preds = [{"id": r["id"], "prediction": rf"\boxed{{{r['answer']}}}"} for r in data.rows]
    assert score_predictions("gpqa_diamond", preds, data=data)[0]["value"] == 1.0
