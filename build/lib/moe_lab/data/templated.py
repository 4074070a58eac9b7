"""Rows rendered as a prompt and a completion by text templates over their fields (GSM8K, CodeAlpaca).

The rendering follows open-instruct's prompt/completion encoding as DenseMixer's public code uses it
(``open_instruct/our_dataset_processor.py``, ``encode_with_prompt_completion_format``): the prompt is not
trained; the completion is, followed by eos; a single space joins them when the prompt does not end and the
completion does not start with whitespace (the space is trained with the completion). The prompt is used
verbatim: no Alpaca wrapper of its own, no chat template (the template carries the whole prompt).

Templates are ``str.format`` strings over row fields, e.g. ``"Question: {question}\\nAnswer:"``;
``prompt_with_input`` (if set) replaces ``prompt`` for rows whose ``input_field`` is a non-empty string
(Alpaca's "with input" variant).
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moe_lab.data.collate import prompt_response_segments
from moe_lab.data.datamodule import SFTDataModule
from moe_lab.data.sources import read_rows, source_label, where


def template_fields(template: str) -> list[str]:
    """Field names a ``str.format`` template reads, in order (``"{a} {b}"`` -> ``["a", "b"]``)."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


@dataclass(frozen=True)
class PromptCompletionFormat:
    """Templates of one dataset: ``prompt``, ``completion`` and the optional ``prompt_with_input``."""

    prompt: str
    completion: str
    prompt_with_input: str | None = None
    input_field: str = "input"

    def render(self, row: Mapping[str, Any], source: str, i: int) -> tuple[str, str]:
        """``(prompt, completion)`` of one row; a missing or non-string field raises naming row/line/field."""
        has_input = isinstance(row.get(self.input_field), str) and row[self.input_field] != ""
        prompt_template = self.prompt_with_input if has_input and self.prompt_with_input else self.prompt
        values = {}
        for field in template_fields(prompt_template) + template_fields(self.completion):
            value = row.get(field)
            if value is None:
                raise ValueError(f"{where(source, i)}: required field '{field}' is missing (or null)")
            if not isinstance(value, str):
                raise TypeError(f"{where(source, i)}: field '{field}' must be a string, got {value!r:.200}")
            values[field] = value
        prompt, completion = prompt_template.format(**values), self.completion.format(**values)
        if not prompt.endswith((" ", "\n", "\t")) and not completion.startswith((" ", "\n", "\t")):
            completion = " " + completion
        return prompt, completion


def prompt_completion_rows(rows: Sequence[Mapping[str, Any]], source: str, fmt: PromptCompletionFormat) -> list[dict]:
    """Rows with ``prompt`` and ``completion`` rendered by ``fmt`` (the source fields are kept)."""
    out = []
    for i, row in enumerate(rows):
        prompt, completion = fmt.render(row, source, i)
        out.append({**row, "prompt": prompt, "completion": completion})
    return out


class PromptCompletionDataModule(SFTDataModule):
    """:class:`SFTDataModule` over rows rendered by templates (module docstring); every other setting (split,
    ``num_examples``, ``max_length``, overflow, packing, batches) as for ``llm_adapters``."""

    def __init__(self, path: str, prompt: str, completion: str, prompt_with_input: str | None = None,
                 input_field: str = "input", **kwargs: Any) -> None:
        if not template_fields(completion):
            raise ValueError(f"dataset.completion={completion!r} names no row field (e.g. '{{answer}}')")
        super().__init__(source="llm_adapters", path=path, **kwargs)
        self.format = PromptCompletionFormat(prompt, completion, prompt_with_input, input_field)

    def load_rows(self) -> list[dict]:
        rows = prompt_completion_rows(read_rows(self.path, split=self.split, name=self.name),
                                      source_label(self.path), self.format)
        random.Random(self.seed).shuffle(rows)
        return rows if self.num_examples is None else rows[: self.num_examples]

    def segments(self, row: Mapping[str, Any]) -> list[tuple[list[int], bool]]:
        return prompt_response_segments(self.tokenizer, row["prompt"], row["completion"])
