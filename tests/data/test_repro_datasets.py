"""DenseMixer's extra training sets (gsm8k_train, codealpaca, nemotron_code / sharegpt) on local fixtures.

Oracle: the expected text of each example is written out here by hand (DenseMixer's public code prompts,
open-instruct's prompt/completion rule) and turned into ids with the byte tokenizer's documented mapping
(bos 1, eos 2, byte b -> b + 3), independently of the rendering code.
"""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from moe_lab.data.templated import PromptCompletionFormat
from moe_lab.data.tokenizer import build_byte_tokenizer

CONF = Path(__file__).resolve().parents[2] / "conf" / "dataset"
BOS, EOS = 1, 2


def byte_ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode("utf-8")]


def expected(prompt: str, response: str) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)``: bos + prompt untrained, response + eos trained."""
    context, trained = [BOS, *byte_ids(prompt)], [*byte_ids(response), EOS]
    return context + trained, [-100] * len(context) + trained


def datamodule(name: str, path: Path, *overrides: str, tokenizer=None):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=name, overrides=[f"path={path}", "val_fraction=0.0", *overrides])
    dm = instantiate(cfg, tokenizer=tokenizer or build_byte_tokenizer())
    dm.setup()
    return dm


def examples_by_prompt_start(dm) -> list[tuple[list[int], list[int]]]:
    return sorted((ex["input_ids"], ex["labels"]) for ex in dm.examples["train"])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------------------
# GSM8K (prompt/completion, "Question: ...\nAnswer:")


def test_gsm8k_prompt_and_supervised_answer(tmp_path):
    rows = [{"question": "Tom has 3 apples and eats 1. How many are left?", "answer": "3 - 1 = <<3-1=2>>2\n#### 2"}]
    dm = datamodule("gsm8k_train", write_jsonl(tmp_path / "gsm.jsonl", rows))
    [(ids, labels)] = examples_by_prompt_start(dm)
    want = expected("Question: Tom has 3 apples and eats 1. How many are left?\nAnswer:",
                    " 3 - 1 = <<3-1=2>>2\n#### 2")
    assert (ids, labels) == want


def test_open_instruct_space_rule():
    fmt = PromptCompletionFormat(prompt="{p}", completion="{c}")
    assert fmt.render({"p": "Q:", "c": "A"}, "x", 0) == ("Q:", " A")       # neither side has whitespace
    assert fmt.render({"p": "Q:\n", "c": "A"}, "x", 0) == ("Q:\n", "A")    # the prompt ends with one
    assert fmt.render({"p": "Q:", "c": "\tA"}, "x", 0) == ("Q:", "\tA")    # the completion starts with one


def test_gsm8k_malformed_rows_name_file_line_field(tmp_path):
    path = tmp_path / "gsm.json"  # a JSON array: row 1 starts on line 5
    path.write_text('[\n  {"question": "q0",\n   "answer": "a0"},\n\n  {"question": "q1"}\n]\n')
    with pytest.raises(ValueError) as info:
        datamodule("gsm8k_train", path)
    assert str(info.value) == f"{path}: row 1 starting at line 5: required field 'answer' is missing (or null)"
    bad = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "a"}, {"question": "q", "answer": 7}])
    with pytest.raises(TypeError, match=r"gsm.jsonl: row 1 starting at line 2: field 'answer' must be a string"):
        datamodule("gsm8k_train", bad)


# ------------------------------------------------------------------------------------------------------------
# CodeAlpaca (DenseMixer Pub's indented Alpaca prompt)

# open-instruct our_dataset_processor.py (DenseMixer), create_code_prompt / create_code_w_input_prompt:
# triple-quoted f-strings whose lines carry the function body's 8-space indentation.
PUB_NO_INPUT = """
        Below is an instruction that describes a task. Write a response that appropriately completes the request.

        ### Instruction:
        Write a function that adds two numbers.

        ### Response:
    """
PUB_WITH_INPUT = """
        Below is an instruction that describes a task, paired with an input that provides further context. \
Write a response that appropriately completes the request.

        ### Instruction:
        Reverse the string.

        ### Input:
        "abc"

        ### Response:
    """


def test_codealpaca_pub_prompts_with_and_without_input(tmp_path):
    rows = [
        {"instruction": "Write a function that adds two numbers.", "input": "", "output": "def add(a, b):\n    return a + b"},
        {"instruction": "Reverse the string.", "input": '"abc"', "output": 's[::-1]'},
    ]
    dm = datamodule("codealpaca", write_jsonl(tmp_path / "code.jsonl", rows))
    got = examples_by_prompt_start(dm)
    want = sorted([expected(PUB_NO_INPUT, "def add(a, b):\n    return a + b"), expected(PUB_WITH_INPUT, "s[::-1]")])
    assert got == want
    for ids, labels in got:  # exactly the response and eos are supervised
        trained = [t for t, lab in zip(ids, labels) if lab != -100]
        assert bytes(t - 3 for t in trained[:-1]).decode() in {"def add(a, b):\n    return a + b", "s[::-1]"}
        assert trained[-1] == EOS


def test_codealpaca_missing_output_names_field(tmp_path):
    path = write_jsonl(tmp_path / "code.jsonl", [{"instruction": "i", "input": "", "output": "o"},
                                                 {"instruction": "i", "input": "x"}])
    with pytest.raises(ValueError, match=r"code.jsonl: row 1 starting at line 2: required field 'output' is missing"):
        datamodule("codealpaca", path)


# Compressed Experts run_sft.py formatting_prompts_func: an f-string inside a function body, so the lines after the
# first carry 8 spaces (the blank ones too), and the no-input branch keeps the "paired with an input" header.
INDENT = " " * 8  # written out, not as trailing whitespace in the source
CE_MAGICODER = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    f"Write a response that appropriately completes the request.\n{INDENT}\n"
    f"{INDENT}### Instruction:\n{INDENT}Print hello.\n{INDENT}\n"
    f"{INDENT}### Response:\n{INDENT}"
)


def test_magicoder_compressed_experts_prompt(tmp_path):
    rows = [{"instruction": "Print hello.", "response": "```python\nprint('hello')\n```"}]
    dm = datamodule("magicoder", write_jsonl(tmp_path / "magic.jsonl", rows))
    [(ids, labels)] = examples_by_prompt_start(dm)
    assert (ids, labels) == expected(CE_MAGICODER, "```python\nprint('hello')\n```\n        ")


# ------------------------------------------------------------------------------------------------------------
# Nemotron code / ShareGPT rows

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_sharegpt_plain_format_trains_assistant_turns_only(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "Sort [2, 1]."}, {"from": "gpt", "value": "[1, 2]"}]}]
    dm = datamodule("nemotron_code", write_jsonl(tmp_path / "nemo.jsonl", rows), "num_examples=null")
    [(ids, labels)] = examples_by_prompt_start(dm)
    assert (ids, labels) == expected("User: Sort [2, 1].\n\nAssistant:", " [1, 2]")  # byte tokenizer: no template


def test_sharegpt_chat_template(tmp_path):
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = CHATML
    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "hi"},
                               {"from": "assistant", "value": "<think>\nok\n</think>\n\nhello"}]}]
    dm = datamodule("nemotron_code", write_jsonl(tmp_path / "nemo.jsonl", rows), tokenizer=tokenizer)
    [(ids, labels)] = examples_by_prompt_start(dm)
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    response = "<think>\nok\n</think>\n\nhello<|im_end|>\n"
    context = [BOS, *byte_ids(prompt)]
    assert ids == context + byte_ids(response)  # the template's end-of-turn marker is trained, no extra eos
    assert labels == [-100] * len(context) + byte_ids(response)


@pytest.mark.parametrize("turn, message", [
    ({"from": "bot", "value": "x"}, "field 'conversations[1].from' must be one of system, user, human, assistant, gpt"),
    ({"from": "gpt", "value": None}, "field 'conversations[1].value' must be a string"),
])
def test_sharegpt_malformed_turn_names_file_line_field(tmp_path, turn, message):
    good = {"conversations": [{"from": "user", "value": "q"}, {"from": "assistant", "value": "a"}]}
    bad = {"conversations": [{"from": "user", "value": "q"}, turn]}
    path = write_jsonl(tmp_path / "nemo.jsonl", [good, good, bad])
    with pytest.raises((ValueError, TypeError)) as info:
        datamodule("nemotron_code", path)
    assert str(info.value).startswith(f"{path}: row 2 starting at line 3: {message}")


def test_sharegpt_without_assistant_turn(tmp_path):
    path = write_jsonl(tmp_path / "nemo.jsonl", [{"conversations": [{"from": "user", "value": "q"}]}])
    with pytest.raises(ValueError, match=r"row 0 starting at line 1: field 'conversations' has no assistant message"):
        datamodule("sharegpt", path)
