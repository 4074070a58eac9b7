"""Commonsense answer formats of the LLM-Adapters prompts, and their multiple-choice (log-likelihood) view.

Generation is scored as in LLM-Adapters (``commonsense_evaluate.py``): the FIRST match of the format's
labels (``true|false``, ``solution1|solution2``, ``answer1|...|answer5``, ``option1|option2``,
``ending1|...|ending4``) anywhere in the stripped generation is the prediction, compared with ``answer``.

The multiple-choice view reads the options back out of the instruction text and scores each continuation
by its log-likelihood (``acc``) and per-byte log-likelihood (``acc_norm``):
``Question: <question>\\nAnswer:`` + ``" <option>"`` (boolq: ``" true"``/``" false"``; hellaswag: the
context itself + ``" <ending>"``); winogrande uses partial scoring: context = the sentence up to the blank,
continuation = option + the rest of the sentence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class AnswerFormat:
    """One LLM-Adapters answer format: its labels (in option order) and the word options are named by."""

    name: str
    labels: tuple[str, ...]
    option_word: str | None  # "Answer" for "Answer1: ..." in the instruction; None when options are the labels

    def extract(self, text: str) -> str | None:
        """The first label occurring in the stripped text (LLM-Adapters' ``re.findall(...)[0]``), else None."""
        found = re.findall("|".join(self.labels), text.strip())
        return found[0] if found else None


FORMATS: dict[str, AnswerFormat] = {
    f.name: f
    for f in (
        AnswerFormat("true_false", ("true", "false"), None),
        AnswerFormat("solution", ("solution1", "solution2"), "Solution"),
        AnswerFormat("answer", tuple(f"answer{i}" for i in range(1, 6)), "Answer"),
        AnswerFormat("option", ("option1", "option2"), "Option"),
        AnswerFormat("ending", tuple(f"ending{i}" for i in range(1, 5)), "Ending"),
    )
}


def get_format(name: str) -> AnswerFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown answer format {name!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


@dataclass(frozen=True)
class ChoiceItem:
    """A multiple-choice item: one context, its continuations, and the index of the gold one."""

    context: str
    choices: list[str]
    gold: int


def row_labels(instruction: str) -> list[str]:
    """The labels the row's own ``Answer format: a/b/c`` line offers (ARC rows have 3, 4 or 5)."""
    _, sep, tail = instruction.rpartition("Answer format:")
    if not sep:
        raise ValueError("instruction has no 'Answer format:' line")
    return [label.strip() for label in tail.strip().split("/")]


def _options(instruction: str, word: str, n: int) -> tuple[str, list[str]]:
    """(text before the first option, [option texts]) for ``<word>1: ... <word>n: ... Answer format:``."""
    starts, pos = [], 0
    for k in range(1, n + 1):
        marker = f"{word}{k}: "
        found = instruction.find(marker, pos)
        if found < 0:
            raise ValueError(f"instruction has no '{marker.strip()}' option")
        starts.append((found, found + len(marker)))
        pos = found + len(marker)
    end = instruction.rfind("Answer format:")
    bounds = [s for s, _ in starts[1:]] + [end]
    texts = [instruction[body:stop].strip() for (_, body), stop in zip(starts, bounds)]
    return instruction[: starts[0][0]], texts


def _question(head: str) -> str:
    """The text after the task description's first ``": "`` ("... to the question: <question>")."""
    return head.split(": ", 1)[1].strip() if ": " in head else head.strip()


def choice_item(fmt: AnswerFormat | str, instruction: str, answer: str) -> ChoiceItem:
    """The multiple-choice view of an LLM-Adapters commonsense row (see module docstring)."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    labels = row_labels(instruction)
    if answer not in labels:
        raise ValueError(f"answer {answer!r} is not one of the row's labels {labels}")
    gold = labels.index(answer)
    if fmt.option_word is None:  # boolq: the labels are the options
        question = _question(instruction.rpartition("Answer format:")[0])
        return ChoiceItem(f"Question: {question}\nAnswer:", [f" {label}" for label in labels], gold)
    head, options = _options(instruction, fmt.option_word, len(labels))
    question = _question(head)
    if fmt.name == "option":  # winogrande: partial scoring around the blank
        if question.count("_") != 1:
            raise ValueError("winogrande sentence must contain exactly one '_' blank")
        prefix, _, suffix = question.partition("_")
        if prefix.endswith(" "):
            return ChoiceItem(prefix.rstrip(), [f" {o}{suffix}" for o in options], gold)
        return ChoiceItem(prefix, [f"{o}{suffix}" for o in options], gold)
    if fmt.name == "ending":
        return ChoiceItem(question, [f" {o}" for o in options], gold)
    return ChoiceItem(f"Question: {question}\nAnswer:", [f" {o}" for o in options], gold)


def hellaswag_row(row: dict) -> dict:
    """A hub HellaSwag row (``activity_label``, ``ctx``, ``endings``, ``label``) in LLM-Adapters' format."""
    endings = " ".join(f"Ending{i + 1}: {e}" for i, e in enumerate(row["endings"]))
    labels = "/".join(f"ending{i + 1}" for i in range(len(row["endings"])))
    instruction = (
        f"Please choose the correct ending to complete the given sentence: {row['activity_label']}: "
        f"{row['ctx']}\n\n{endings}\n\nAnswer format: {labels}"
    )
    answer = f"ending{int(row['label']) + 1}"
    return {"instruction": instruction, "input": "", "output": f"the correct answer is {answer}", "answer": answer}
