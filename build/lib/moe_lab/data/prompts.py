"""Prompt formatting: LLM-Adapters' Alpaca-style prompt, or the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_INDENT = " " * 16

# LLM-Adapters (AGI-Edgerunners/LLM-Adapters, finetune.py ``generate_prompt``) writes these as indented
# triple-quoted f-strings. We keep its words and the trailing spaces after "request." (one with input,
# two without) but dedent: the 16-space indentation in front of every line (and the whitespace-only
# separator lines) is dropped. ``verbatim=True`` reproduces the indented original byte for byte.
_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request. \n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.  \n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
_WITH_INPUT_VERBATIM = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request. \n\n"
    f"{_INDENT}### Instruction:\n{_INDENT}{{instruction}}\n{_INDENT}\n"
    f"{_INDENT}### Input:\n{_INDENT}{{input}}\n{_INDENT}\n"
    f"{_INDENT}### Response:\n{_INDENT}"
)
_NO_INPUT_VERBATIM = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.  \n\n"
    f"{_INDENT}### Instruction:\n{_INDENT}{{instruction}}\n{_INDENT}\n"
    f"{_INDENT}### Response:\n{_INDENT}"
)


def format_prompt(instruction: str, input: str = "", verbatim: bool = False) -> str:
    """Alpaca prompt of LLM-Adapters up to and including ``"### Response:\\n"``; append the output to it.

    Dedented by default (see module comment); ``verbatim=True`` keeps LLM-Adapters' 16-space indentation.
    The ``### Input:`` block is used only when ``input`` is non-empty, as in LLM-Adapters.
    """
    if input:
        template = _WITH_INPUT_VERBATIM if verbatim else _WITH_INPUT
        return template.format(instruction=instruction, input=input)
    template = _NO_INPUT_VERBATIM if verbatim else _NO_INPUT
    return template.format(instruction=instruction)


def format_chat(tokenizer: Any, instruction: str, input: str = "") -> str:
    """Prompt text from the tokenizer's chat template: one user turn, ``add_generation_prompt=True``.

    The user message is the instruction, followed by ``"\\n\\n" + input`` when input is non-empty.
    """
    content = f"{instruction}\n\n{input}" if input else instruction
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def build_prompt(tokenizer: Any, row: Mapping[str, Any]) -> str:
    """Prompt for a row (``instruction``, optional ``input``): chat template if the tokenizer has one, else Alpaca."""
    instruction, inp = row["instruction"], row.get("input") or ""
    if getattr(tokenizer, "chat_template", None):
        return format_chat(tokenizer, instruction, inp)
    return format_prompt(instruction, inp)
