"""Reasoning-trace rows (s1K: question + thinking trace + answer) as chat conversations.

The assistant turn follows s1 (simplescaling/s1, ``data/tokenization.py``)::

    <|im_start|>think\\n{trace}\\n<|im_start|>answer\\n{"Answer: " unless the attempt says "Answer:"}{attempt}

with the trace's pieces joined by newlines. The markers are options, so a model with its own thinking
tokens can use them instead (Qwen3: ``think_prefix="<think>\\n"``, ``answer_prefix="\\n</think>\\n\\n"``).
The conversation then goes through ``moe_lab.data.chat`` (loss on the assistant turn only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from moe_lab.data.sources import where


@dataclass(frozen=True)
class ReasoningFormat:
    """Field names of a reasoning dataset and the markers that wrap the trace (s1K defaults)."""

    question_field: str = "question"
    trace_field: str = "thinking_trajectories"
    answer_field: str = "attempt"
    think_prefix: str = "<|im_start|>think\n"
    answer_prefix: str = "\n<|im_start|>answer\n"
    answer_label: str = "Answer: "

    def assistant_text(self, trace: str, answer: str) -> str:
        """The trained assistant content: trace wrapped as thinking, then the labelled answer."""
        label = "" if self.answer_label.strip() in answer else self.answer_label
        return f"{self.think_prefix}{trace.strip()}{self.answer_prefix}{label}{answer.strip()}"


def reasoning_format(options: Mapping[str, str] | None) -> ReasoningFormat:
    """``ReasoningFormat`` from ``dataset.reasoning`` options; an unknown option raises naming the valid ones."""
    options = dict(options or {})
    valid = [f.name for f in fields(ReasoningFormat)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"dataset.reasoning has unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return ReasoningFormat(**options)


def _text(value: Any, row_where: str, field: str, allow_list: bool) -> str:
    if isinstance(value, str):
        return value
    if allow_list and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    kind = "a string or a non-empty list of strings" if allow_list else "a string"
    raise ValueError(f"{row_where}: field '{field}' must be {kind}, got {value!r:.200}")


def reasoning_messages(row: Mapping[str, Any], fmt: ReasoningFormat, source: str, i: int) -> list[dict]:
    """``[user: question, assistant: thinking + answer]`` for one row; a bad field raises naming row/line/field."""
    row_where = where(source, i)
    for field in (fmt.question_field, fmt.trace_field, fmt.answer_field):
        if row.get(field) is None:
            raise ValueError(f"{row_where}: required field '{field}' is missing (or null)")
    question = _text(row[fmt.question_field], row_where, fmt.question_field, allow_list=False)
    trace = _text(row[fmt.trace_field], row_where, fmt.trace_field, allow_list=True)
    answer = _text(row[fmt.answer_field], row_where, fmt.answer_field, allow_list=False)
    return [
        {"role": "user", "content": question, "mask": False},
        {"role": "assistant", "content": fmt.assistant_text(trace, answer), "mask": False},
    ]


def reasoning_rows(rows: Sequence[Mapping[str, Any]], source: str, fmt: ReasoningFormat) -> list[dict]:
    """Rows with a ``messages`` conversation built by ``reasoning_messages`` (other fields kept)."""
    return [{**row, "messages": reasoning_messages(row, fmt, source, i)} for i, row in enumerate(rows)]
