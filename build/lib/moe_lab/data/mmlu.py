"""MMLU-style multiple-choice rows (``question``, ``choices``, ``answer`` index; ``cais/mmlu``) as SFT examples.

The prompt is lm-eval's zero-shot MMLU context (``lm_eval/tasks/mmlu/default``: the task description, then
``doc_to_text``)::

    The following are multiple choice questions (with answers) about {subject}.\\n\\n
    {question.strip()}\\nA. {choice 0}\\nB. {choice 1}\\nC. {choice 2}\\nD. {choice 3}\\nAnswer:

with the subject's underscores as spaces; a row without a subject (``auxiliary_train``: ARC, MCTest, OBQA,
RACE) gets the description without "about ...". The trained response is the answer as lm-eval scores it:
``" " + letter`` (``response=letter``; lm-eval's target delimiter and choice) or ``" B. <choice text>"``
(``response=letter_text``), followed by eos. The prompt is used verbatim (no Alpaca wrapper, no chat template),
so training sees exactly the context lm-eval evaluates. ``cais/mmlu``'s ``auxiliary_train`` config nests each
row under a ``train`` key; such rows are unwrapped.
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from typing import Any

from moe_lab.data.collate import prompt_response_segments
from moe_lab.data.datamodule import SFTDataModule
from moe_lab.data.sources import read_rows, source_label, where

LETTERS = string.ascii_uppercase
RESPONSES = ("letter", "letter_text")
DESCRIPTION = "The following are multiple choice questions (with answers){about}.\n\n"


def mmlu_prompt(question: str, choices: Sequence[str], subject: str = "") -> str:
    """lm-eval's zero-shot MMLU context for one question (see the module docstring)."""
    about = f" about {subject.replace('_', ' ')}" if subject else ""
    options = "".join(f"\n{LETTERS[i]}. {choice}" for i, choice in enumerate(choices))
    return f"{DESCRIPTION.format(about=about)}{question.strip()}{options}\nAnswer:"


def _answer_index(value: Any, n: int, row_where: str) -> int:
    if isinstance(value, str) and len(value) == 1 and value in LETTERS:
        value = LETTERS.index(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise ValueError(f"{row_where}: field 'answer' must be a choice index 0..{n - 1} (or its letter), "
                         f"got {value!r}")
    return value


def mmlu_rows(rows: Sequence[Mapping[str, Any]], source: str, response: str = "letter") -> list[dict]:
    """Rows as ``{"instruction": prompt, "input": "", "output": response, "answer": letter}``; a bad row
    raises naming the row (and line for JSON files) and the field."""
    if response not in RESPONSES:
        raise ValueError(f"dataset.response={response!r}: choose one of {', '.join(RESPONSES)}")
    out = []
    for i, row in enumerate(rows):
        if set(row) == {"train"} and isinstance(row["train"], Mapping):  # cais/mmlu auxiliary_train layout
            row = row["train"]
        row_where = where(source, i)
        question, choices, subject = row.get("question"), row.get("choices"), row.get("subject") or ""
        if question is None:
            raise ValueError(f"{row_where}: required field 'question' is missing (or null)")
        if not isinstance(question, str):
            raise TypeError(f"{row_where}: field 'question' must be a string, got {question!r:.200}")
        if not (isinstance(choices, list) and 2 <= len(choices) <= len(LETTERS)
                and all(isinstance(c, str) for c in choices)):
            raise ValueError(f"{row_where}: field 'choices' must be a list of 2 to {len(LETTERS)} strings, "
                             f"got {choices!r:.200}")
        if not isinstance(subject, str):
            raise TypeError(f"{row_where}: field 'subject' must be a string, got {subject!r:.200}")
        k = _answer_index(row.get("answer"), len(choices), row_where)
        output = f" {LETTERS[k]}" if response == "letter" else f" {LETTERS[k]}. {choices[k]}"
        out.append({"instruction": mmlu_prompt(question, choices, subject), "input": "", "output": output,
                    "answer": LETTERS[k]})
    return out


class MMLUDataModule(SFTDataModule):
    """:class:`SFTDataModule` over MMLU-style rows (:func:`mmlu_rows`), prompts used verbatim; every other
    setting (split, ``num_examples``, ``max_length``, overflow, packing, batches) as for ``llm_adapters``."""

    def __init__(self, path: str, response: str = "letter", **kwargs: Any) -> None:
        if response not in RESPONSES:
            raise ValueError(f"dataset.response={response!r}: choose one of {', '.join(RESPONSES)}")
        super().__init__(source="llm_adapters", path=path, **kwargs)
        self.response = response

    def load_rows(self) -> list[dict]:
        rows = mmlu_rows(read_rows(self.path, split=self.split, name=self.name), source_label(self.path),
                         self.response)
        random.Random(self.seed).shuffle(rows)
        return rows if self.num_examples is None else rows[: self.num_examples]

    def segments(self, row: Mapping[str, Any]) -> list[tuple[list[int], bool]]:
        return prompt_response_segments(self.tokenizer, row["instruction"], row["output"])
