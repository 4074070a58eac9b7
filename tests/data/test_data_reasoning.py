import json

import pytest

from moe_lab.data.collate import IGNORE_INDEX
from moe_lab.data.datamodule import SFTDataModule
from moe_lab.data.reasoning import ReasoningFormat, reasoning_messages
from moe_lab.data.tokenizer import build_byte_tokenizer

S1K_ROW = {  # the columns of simplescaling/s1K
    "solution": "5",
    "question": "What is 2 + 3?",
    "cot_type": "math",
    "source_type": "toy",
    "metadata": "{}",
    "cot": None,
    "thinking_trajectories": ["Add the numbers.", "2 + 3 = 5."],
    "attempt": "The sum is 5.",
}


def test_s1_format_by_hand():
    messages = reasoning_messages(S1K_ROW, ReasoningFormat(), "s1K", 0)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "What is 2 + 3?"
    assert messages[1]["content"] == (
        "<|im_start|>think\nAdd the numbers.\n2 + 3 = 5.\n<|im_start|>answer\nAnswer: The sum is 5."
    )
    already = {**S1K_ROW, "attempt": "Answer: 5"}  # s1 adds "Answer: " only when the attempt lacks it
    assert reasoning_messages(already, ReasoningFormat(), "s1K", 0)[1]["content"].endswith("answer\nAnswer: 5")


def test_s1k_1_1_fields_and_qwen3_markers():
    row = {"question": "Q?", "deepseek_thinking_trajectory": "  think hard  ", "deepseek_attempt": "42"}
    fmt = ReasoningFormat(trace_field="deepseek_thinking_trajectory", answer_field="deepseek_attempt",
                          think_prefix="<think>\n", answer_prefix="\n</think>\n\n", answer_label="")
    assert reasoning_messages(row, fmt, "s1K-1.1", 0)[1]["content"] == "<think>\nthink hard\n</think>\n\n42"


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [("attempt", None, ValueError, "'attempt' is missing"),
     ("thinking_trajectories", [1, 2], ValueError, "'thinking_trajectories' must be a string or a non-empty list"),
     ("question", ["a"], ValueError, "'question' must be a string")],
)
def test_bad_reasoning_row_names_line_and_field(tmp_path, field, value, error, message):
    rows = [dict(S1K_ROW) for _ in range(3)]
    rows[1][field] = value
    path = tmp_path / "s1k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = SFTDataModule(source="reasoning", path=str(path), tokenizer=build_byte_tokenizer())
    with pytest.raises(error, match=message) as info:
        dm.setup()
    assert "s1k.jsonl: row 1 starting at line 2" in str(info.value)


def test_reasoning_datamodule_and_overflow_policies(tmp_path, caplog):
    rows = [{**S1K_ROW, "thinking_trajectories": ["step " * n], "question": f"q{n}"} for n in (1, 5, 40, 80)]
    path = tmp_path / "s1k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"source": "reasoning", "path": str(path), "val_fraction": 0.0, "tokenizer": build_byte_tokenizer()}
    lengths = {}
    full = SFTDataModule(**common, max_length=10_000)
    full.setup()
    for row, ex in zip(full.rows["train"], full.examples["train"]):
        assistant = row["messages"][1]["content"]
        assert [t for t in ex["labels"] if t != IGNORE_INDEX] == [x + 3 for x in f" {assistant}".encode()] + [2]
        lengths[row["question"]] = len(ex["input_ids"])
    assert full.overflow_counts["train"] == {"kept": 4}
    # q40 (~280 tokens) and q80 (~480) are longer than 250; the prompt is ~20 tokens, so both keep a response
    limit = 250
    assert lengths["q1"] < lengths["q5"] < limit < lengths["q40"] < lengths["q80"]
    cut = SFTDataModule(**common, max_length=limit)
    with caplog.at_level("INFO", logger="moe_lab.data.datamodule"):
        cut.setup()
    assert "overflow=truncate at max_length=250: 2 kept whole, 2 truncated, 0 dropped as too long" in caplog.text
    assert cut.overflow_counts["train"] == {"kept": 2, "truncated": 2} and cut.num_skipped["train"] == 0
    assert sorted(len(ex["input_ids"]) for ex in cut.examples["train"]) == sorted([lengths["q1"], lengths["q5"],
                                                                                    limit, limit])
    skip = SFTDataModule(**common, max_length=limit, overflow="skip")
    skip.setup()
    assert skip.overflow_counts["train"] == {"kept": 2, "too_long": 2} and skip.num_skipped["train"] == 2
    assert sorted(len(ex["input_ids"]) for ex in skip.examples["train"]) == sorted([lengths["q1"], lengths["q5"]])
    tiny = SFTDataModule(**common, max_length=12)  # the prompt alone is longer: nothing to train on
    with pytest.raises(ValueError, match="All 4 train examples were dropped"):
        tiny.setup()
    with pytest.raises(ValueError, match="truncate, skip"):
        SFTDataModule(**common, overflow="drop")
    with pytest.raises(ValueError, match="unknown option.*trace_feild.*valid: question_field"):
        SFTDataModule(**common, reasoning={"trace_feild": "x"})
