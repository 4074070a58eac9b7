from moe_lab.data.prompts import build_prompt, format_chat, format_prompt
from moe_lab.data.tokenizer import build_byte_tokenizer

HEAD_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request. "
)
HEAD_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request.  "


def test_alpaca_without_input():
    expected = HEAD_NO_INPUT + "\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n"
    assert format_prompt("Add 2 and 3.") == expected
    assert format_prompt("Add 2 and 3.", "") == expected


def test_alpaca_with_input():
    expected = HEAD_INPUT + "\n\n### Instruction:\nAdd the numbers.\n\n### Input:\n2, 3\n\n### Response:\n"
    assert format_prompt("Add the numbers.", "2, 3") == expected


SP, IND = " ", " " * 16  # trailing spaces written explicitly so editors that strip them can't break this


def _llm_adapters_generate_prompt(data_point):
    # AGI-Edgerunners/LLM-Adapters finetune.py generate_prompt, indentation kept; {SP}/{IND} mark the
    # trailing spaces after "request." and the whitespace-only lines of the original.
    if data_point["input"]:
        return f"""Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.{SP}

                ### Instruction:
                {data_point["instruction"]}
{IND}
                ### Input:
                {data_point["input"]}
{IND}
                ### Response:
                {data_point["output"]}"""
    else:
        return f"""Below is an instruction that describes a task. Write a response that appropriately completes the request.{SP}{SP}

                ### Instruction:
                {data_point["instruction"]}
{IND}
                ### Response:
                {data_point["output"]}"""


def test_verbatim_matches_llm_adapters_source():
    for row in (
        {"instruction": "Q?", "input": "", "output": "A."},
        {"instruction": "Q?", "input": "ctx", "output": "A."},
    ):
        got = format_prompt(row["instruction"], row["input"], verbatim=True) + row["output"]
        assert got == _llm_adapters_generate_prompt(row)


def test_dedented_equals_source_with_indent_removed():
    for row in (
        {"instruction": "Q?", "input": "", "output": "A."},
        {"instruction": "Q?", "input": "ctx", "output": "A."},
    ):
        original = "\n".join(
            line[16:] if line.startswith(" " * 16) else line
            for line in _llm_adapters_generate_prompt(row).split("\n")
        )
        assert format_prompt(row["instruction"], row["input"]) + row["output"] == original


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_build_prompt_chooses_template():
    tok = build_byte_tokenizer()
    row = {"instruction": "Add the numbers.", "input": "2, 3", "output": "5"}
    assert build_prompt(tok, row) == format_prompt("Add the numbers.", "2, 3")
    assert build_prompt(tok, {"instruction": "Hi"}) == format_prompt("Hi")
    tok.chat_template = CHAT_TEMPLATE
    assert (
        format_chat(tok, "Add the numbers.", "2, 3") == "<|user|>Add the numbers.\n\n2, 3<|end|><|assistant|>"
    )
    assert build_prompt(tok, row) == "<|user|>Add the numbers.\n\n2, 3<|end|><|assistant|>"
    assert build_prompt(tok, {"instruction": "Hi", "input": ""}) == "<|user|>Hi<|end|><|assistant|>"
