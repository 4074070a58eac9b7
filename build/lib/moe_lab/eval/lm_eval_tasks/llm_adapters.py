"""Document loaders and scoring for the lm-eval task definitions over the LLM-Adapters test files.

lm-eval calls ``custom_dataset(**metadata, **dataset_kwargs)``: ``data_dir`` comes from the metadata (the
bridge passes it; on the lm-eval CLI use ``--metadata '{"data_dir": "/path/to/llm_adapters"}'``) and
``eval_set`` (a moe-lab evaluation set name) from the task's ``dataset_kwargs``.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset, DatasetDict

from moe_lab.data.prompts import format_prompt
from moe_lab.eval.choices import choice_item
from moe_lab.eval.eval_sets import get_eval_set, load_eval_set
from moe_lab.eval.score import check_gold, score_text


def load_choice_docs(eval_set: str, data_dir: str | None = None, **_: Any) -> DatasetDict:
    """Multiple-choice docs (``context``, ``choices``, ``gold``) of a commonsense set: the options of each
    row's own instruction, as ``moe_lab.eval.choices.choice_item`` reads them (the view moe-lab scores)."""
    data = load_eval_set(eval_set, data_dir)
    spec = data.spec
    if spec.answer_format is None:
        raise ValueError(f"evaluation set {spec.name!r} is not multiple choice (no answer format)")
    docs = []
    for i, row in enumerate(data.rows):
        try:
            item = choice_item(spec.answer_format, row["instruction"], check_gold(spec, row))
        except ValueError as err:
            raise ValueError(f"{data.where(i)}: {err}") from err
        docs.append({"context": item.context, "choices": item.choices, "gold": item.gold})
    return DatasetDict({"test": Dataset.from_list(docs)})


def load_generation_docs(eval_set: str, data_dir: str | None = None, **_: Any) -> DatasetDict:
    """Generative docs (``prompt`` = the LLM-Adapters Alpaca prompt, ``answer``) of a math set."""
    data = load_eval_set(eval_set, data_dir)
    docs = []
    for i, row in enumerate(data.rows):
        try:
            check_gold(data.spec, row)
        except ValueError as err:
            raise ValueError(f"{data.where(i)}: {err}") from err
        prompt = format_prompt(row["instruction"], row.get("input") or "")
        docs.append({"prompt": prompt, "answer": str(row["answer"]), "eval_set": data.spec.name})
    return DatasetDict({"test": Dataset.from_list(docs)})


def process_generation(doc: dict, results: list[str]) -> dict[str, float]:
    """``acc`` of one generation: moe-lab's answer extraction for the set (``moe_lab.eval.score``)."""
    spec = get_eval_set(doc["eval_set"])
    return {"acc": score_text(spec, check_gold(spec, doc), results[0])["score"]}
