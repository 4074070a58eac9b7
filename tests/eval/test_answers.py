"""Math answer extraction: LLM-Adapters' conventions, hand cases, and every shared math test file."""

from __future__ import annotations

import json

import pytest

from moe_lab.eval.answers import (
    extract_boxed,
    extract_choice_letter,
    extract_final_answer,
    extract_letter,
    extract_number,
    math_equal,
    normalize_math_answer,
    numbers_match,
    parse_gold_number,
)
from moe_lab.eval.eval_sets import GROUPS, get_eval_set, load_eval_set
from moe_lab.eval.score import score_predictions
from tests.conftest import DATA_DIR

MATH7 = GROUPS["math7"]

# Scoring each file's own `output` field (rationales written by another model) as the predictions:
# (correct, rows, empty generations, no extractable answer) per extraction mode.
OUTPUT_FIELD_COUNTS = {
    "answer_is": {
        "gsm8k": (771, 1319, 6, 0), "svamp": (803, 1000, 0, 0), "multiarith": (560, 600, 0, 0),
        "addsub": (370, 395, 0, 0), "aqua": (123, 254, 0, 1), "singleeq": (484, 508, 0, 0),
        "mawps": (0, 238, 238, 0),
    },
    "llm_adapters": {
        "gsm8k": (771, 1319, 6, 0), "svamp": (803, 1000, 0, 0), "multiarith": (560, 600, 0, 0),
        "addsub": (370, 395, 0, 0), "aqua": (109, 254, 0, 1), "singleeq": (484, 508, 0, 0),
        "mawps": (0, 238, 238, 0),
    },
}


@pytest.mark.parametrize("text,answer_is,last", [
    ("A: 7 - 3 = 4 crayons. The answer is 4.", 4.0, 4.0),
    ("The answer is 40 - 29 = 11 holes. The pirates dug 11 holes on day 4", 11.0, 4.0),
    ("So, the answer is 5 arms and 3 legs, or 8 limbs in total.", 8.0, 8.0),
    ("He earned $1,234.50 in total. The answer is 1,234.5.", 1234.5, 1234.5),
    ("the answer is: -15.0\nQuestion 2: 7 apples", -15.0, 7.0),
    ("The answer is forty. Before that 12 and 13", 13.0, 13.0),  # no number in the sentence: last number
    ("2 + 3 = 5", 5.0, 5.0),
    ("The answer is 4.5.", 4.5, 4.5),
])
def test_extract_number_modes(text, answer_is, last):
    assert extract_number(text) == answer_is
    assert extract_number(text, mode="llm_adapters") == last


def test_extract_number_none_and_bad_mode():
    assert extract_number("no digits here") is None
    assert extract_number("") is None
    with pytest.raises(ValueError, match="answer_is, llm_adapters"):
        extract_number("1", mode="lm_eval")


@pytest.mark.parametrize("text,answer_is,first_capital", [
    ("The answer is (D).", "D", "D"),
    ("Rationale: Bill drives 11 mph. Cost = Rs. 7.5. The answer is (B).", "B", "B"),
    ("Rationale: Distance D = 4 km. The answer is (A).", "A", "D"),  # LLM-Adapters takes the first capital
    ("The answer is option C", "C", "C"),
    ("the answer is a prime, so E", "E", "E"),  # lower-case 'a' is no option letter
    ("no option at all", None, None),
])
def test_extract_letter_modes(text, answer_is, first_capital):
    assert extract_letter(text) == answer_is
    assert extract_letter(text, mode="llm_adapters") == first_capital


def test_gold_parsing_and_tolerance():
    assert parse_gold_number("576.0") == 576.0 and parse_gold_number("1,250") == 1250.0
    assert parse_gold_number(" -15.0 ") == -15.0
    for bad in ("abc", "", "3/4", "12 apples"):
        with pytest.raises(ValueError, match="not a number"):
            parse_gold_number(bad)
    assert numbers_match(576.0, parse_gold_number("576.0"))
    assert numbers_match(0.667, 0.6666666666666666)  # |diff| = 0.00033 <= 0.001
    assert not numbers_match(0.668, 0.6666666666666666)  # 0.0013 > 0.001


def test_boxed_and_math_equivalence():
    assert extract_boxed(r"first \boxed{2} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{\left(3, \frac{\pi}{2}\right)}") == r"\left(3, \frac{\pi}{2}\right)"
    assert extract_boxed("no box") is None and extract_boxed(r"\boxed{unclosed") is None
    assert normalize_math_answer(r"\left( 3, \dfrac{\pi}{2} \right)") == r"(3,\frac{\pi}{2})"
    assert math_equal(r"\dfrac12", r"\frac{1}{2}") and math_equal("0.5", r"\frac{1}{2}")
    assert math_equal("x = 7", "7") and math_equal("10\\%", "10") and math_equal("033", "33")
    assert not math_equal(r"\frac{1}{3}", r"\frac{1}{2}") and not math_equal(None, "1")
    assert extract_final_answer(r"so the total is \boxed{204}.") == "204"
    assert extract_final_answer("The answer is 204. Check: 17") == "204"
    assert extract_choice_letter(r"Thus \boxed{\text{(C)}}") == "C"
    assert extract_choice_letter("The answer is (B).") == "B" and extract_choice_letter("A B C D") is None


def _rows(name):
    return load_eval_set(name, DATA_DIR)


@pytest.mark.parametrize("name", MATH7)
def test_gold_answer_in_answer_style_scores_100_and_wrong_scores_0(name):
    data = _rows(name)
    gold = {i: f"The answer is {r['answer']}" for i, r in enumerate(data.rows)}
    summary, per_item = score_predictions(name, gold, data=data)
    assert summary["value"] == 1.0 and summary["n_correct"] == len(data.rows) == summary["n_scored"]
    assert summary["complete"] and summary["bad_gold"] == []
    if get_eval_set(name).kind == "math_letter":
        wrong = {i: "The answer is " + "BCDEA"["ABCDE".index(r["answer"])] for i, r in enumerate(data.rows)}
    else:
        wrong = {i: f"The answer is {float(r['answer']) + 1}" for i, r in enumerate(data.rows)}
    summary, per_item = score_predictions(name, wrong, data=data)
    assert summary["value"] == 0.0 and {it["status"] for it in per_item} == {"wrong"}


@pytest.mark.parametrize("mode", ["answer_is", "llm_adapters"])
@pytest.mark.parametrize("name", MATH7)
def test_output_field_accuracy_is_pinned(name, mode):
    data = _rows(name)
    outputs = {i: r["output"] for i, r in enumerate(data.rows)}
    summary, _ = score_predictions(name, outputs, data=data, mode=mode)
    correct, rows, empty, no_answer = OUTPUT_FIELD_COUNTS[mode][name]
    assert (summary["n_correct"], summary["n_scored"]) == (correct, rows)
    assert summary["value"] == pytest.approx(correct / rows)
    assert summary["statuses"].get("empty", 0) == empty
    assert summary["statuses"].get("no_answer", 0) == no_answer
    assert summary["statuses"].get("wrong", 0) == rows - correct - empty - no_answer


def test_independent_recount_of_gsm8k_outputs():
    """An independent re-implementation of LLM-Adapters' loop over the raw file gives the pinned count."""
    import re

    rows = json.loads((DATA_DIR / "gsm8k.test.json").read_text())
    correct = 0
    for row in rows:
        found = re.findall(r"-?\d+\.?\d*", row["output"].replace(",", ""))
        pred = float(found[-1]) if found else float("inf")
        correct += abs(float(row["answer"]) - pred) <= 0.001
    assert correct == OUTPUT_FIELD_COUNTS["llm_adapters"]["gsm8k"][0]


def test_empty_generation_and_bad_gold_are_reported(tmp_path):
    rows = [
        {"instruction": "q0", "output": "", "answer": "3.0"},
        {"instruction": "q1", "output": "", "answer": "three"},
        {"instruction": "q2", "output": ""},
        {"instruction": "q3", "output": "", "answer": "4"},
    ]
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(rows, indent=1))
    preds = {0: "   ", 1: "The answer is 3", 2: "The answer is 1", 3: "The answer is 4"}
    summary, per_item = score_predictions("gsm8k", preds, path=path)
    assert [it["status"] for it in per_item] == ["empty", "bad_gold", "bad_gold", "correct"]
    assert summary["n_scored"] == 2 and summary["value"] == 0.5  # the empty one counts as wrong
    assert len(summary["bad_gold"]) == 2
    assert f"{path}: row 1 (line 7)" in summary["bad_gold"][0] and "'three' is not a number" in summary["bad_gold"][0]
    assert f"{path}: row 2 (line 12)" in summary["bad_gold"][1] and "no 'answer'" in summary["bad_gold"][1]
