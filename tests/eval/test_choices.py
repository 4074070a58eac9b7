"""Commonsense answer formats on every row of the shared files, and their multiple-choice view."""

from __future__ import annotations

import pytest

from moe_lab.eval.choices import FORMATS, choice_item, get_format, hellaswag_row, row_labels
from moe_lab.eval.eval_sets import EVAL_SETS, GROUPS, load_eval_set
from moe_lab.eval.score import score_predictions
from tests.conftest import DATA_DIR

SHARED_COMMONSENSE = [n for n in GROUPS["commonsense8"] if EVAL_SETS[n].file]
# number of options per row (from each row's own "Answer format:" line) -> rows
OPTION_COUNTS = {
    "boolq": {2: 3270}, "piqa": {2: 1838}, "siqa": {3: 1954}, "winogrande": {2: 1267},
    "arc_e": {3: 7, 4: 2365, 5: 4}, "arc_c": {3: 4, 4: 1165, 5: 3}, "obqa": {4: 500},
}


@pytest.mark.parametrize("name", SHARED_COMMONSENSE)
def test_format_parses_every_answer_and_every_row_has_a_choice_view(name):
    spec = EVAL_SETS[name]
    fmt = get_format(spec.answer_format)
    data = load_eval_set(name, DATA_DIR)
    counts: dict[int, int] = {}
    for i, row in enumerate(data.rows):
        answer = row["answer"]
        assert fmt.extract(answer) == answer, (i, answer)
        assert fmt.extract(f"the correct answer is {answer}") == answer
        assert row_labels(row["instruction"])[0] == fmt.labels[0]
        item = choice_item(fmt, row["instruction"], answer)
        assert len(item.choices) == len(row_labels(row["instruction"]))
        assert all(c.strip() for c in item.choices) and item.context.strip()
        assert row_labels(row["instruction"])[item.gold] == answer
        counts[len(item.choices)] = counts.get(len(item.choices), 0) + 1
    assert counts == OPTION_COUNTS[name]
    summary, _ = score_predictions(name, {i: r["output"] for i, r in enumerate(data.rows)}, data=data)
    assert summary["value"] == 1.0 and summary["n_scored"] == len(data.rows)  # outputs state the answer


def test_first_match_convention_of_llm_adapters():
    answer = FORMATS["answer"]
    assert answer.extract("answer2, not answer1") == "answer2"
    assert answer.extract("Answer2") is None  # case-sensitive, as in LLM-Adapters
    assert FORMATS["true_false"].extract("that is untrue") == "true"  # LLM-Adapters' regex has no word bounds
    assert FORMATS["ending"].extract("ending5 ending3") == "ending3"
    with pytest.raises(ValueError, match="true_false, solution, answer, option, ending"):
        get_format("letters")


def test_choice_views_by_hand():
    arc = ("Please choose the correct answer to the question: Which is a gas?\n\nAnswer1: ice Answer2: steam "
           "Answer3: rock\n\nAnswer format: answer1/answer2/answer3")
    item = choice_item("answer", arc, "answer2")
    assert item.context == "Question: Which is a gas?\nAnswer:"
    assert item.choices == [" ice", " steam", " rock"] and item.gold == 1
    wino = ("Please choose the correct answer to fill in the blank to complete the given sentence: Sarah was a "
            "better surgeon than Maria so _ always got the easier cases.\n\nOption1: Sarah Option2: Maria Answer "
            "format: option1/option2")
    item = choice_item("option", wino, "option2")
    assert item.context == "Sarah was a better surgeon than Maria so"
    assert item.choices == [" Sarah always got the easier cases.", " Maria always got the easier cases."]
    boolq = ("Please answer the following question with true or false, question: is the sky blue?\n\n"
             "Answer format: true/false")
    item = choice_item("true_false", boolq, "false")
    assert (item.context, item.choices, item.gold) == ("Question: is the sky blue?\nAnswer:", [" true", " false"], 1)
    with pytest.raises(ValueError, match="not one of the row's labels"):
        choice_item("answer", arc, "answer4")


def test_hub_hellaswag_rows_become_llm_adapters_rows():
    row = hellaswag_row({"activity_label": "Drums", "ctx": "A man stands behind drums. He",
                         "endings": ["eats.", "plays them.", "sleeps.", "leaves."], "label": "1"})
    assert row["answer"] == "ending2"
    assert row["instruction"].startswith("Please choose the correct ending to complete the given sentence: Drums: ")
    item = choice_item("ending", row["instruction"], row["answer"])
    assert item.context == "Drums: A man stands behind drums. He"
    assert item.choices == [" eats.", " plays them.", " sleeps.", " leaves."] and item.gold == 1
    assert FORMATS["ending"].extract(row["output"]) == "ending2"
