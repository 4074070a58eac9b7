"""Tokenize prompt/response pairs with loss masking, and pad them into batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

IGNORE_INDEX = -100


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a prompt exactly as training sees them: bos first when the tokenizer has one.

    The text is encoded without special tokens, then bos is prepended unless the text already produced it
    (chat templates often write bos as text). Use this at generation time too, so prompts match training.
    """
    return with_bos(tokenizer, text_ids(tokenizer, prompt))


#: ``dataset.overflow`` policies for examples longer than ``max_length``.
OVERFLOW_POLICIES = ("truncate", "skip")
#: Outcomes of ``assemble``: kept whole, cut to ``max_length``, dropped because too long (``skip`` policy),
#: dropped because no trained token is left (or there never was one).
OUTCOMES = ("kept", "truncated", "too_long", "no_labels")


def check_overflow(overflow: str) -> str:
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"dataset.overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {overflow!r}")
    return overflow


def assemble(
    segments: Sequence[tuple[Sequence[int], bool]], max_length: int, overflow: str = "truncate"
) -> tuple[dict | None, str]:
    """Join ``(token ids, trained)`` segments into ``{"input_ids", "labels"}``; labels are -100 where not trained.

    Longer than ``max_length``: ``overflow="truncate"`` cuts the end (the start of the prompt is kept),
    ``"skip"`` drops the example. Returns ``(example or None, outcome)`` with outcome in ``OUTCOMES``; an
    example with no trained token left is dropped (``"no_labels"``) so nothing trains on zero loss tokens.
    """
    check_overflow(overflow)
    input_ids: list[int] = []
    labels: list[int] = []
    for ids, trained in segments:
        input_ids.extend(ids)
        labels.extend(ids if trained else [IGNORE_INDEX] * len(ids))
    outcome = "kept"
    if len(input_ids) > max_length:
        if overflow == "skip":
            return None, "too_long"
        input_ids, labels, outcome = input_ids[:max_length], labels[:max_length], "truncated"
    if all(label == IGNORE_INDEX for label in labels):
        return None, "no_labels"
    return {"input_ids": input_ids, "labels": labels}, outcome


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def with_bos(tokenizer: Any, ids: list[int]) -> list[int]:
    """``ids`` with the tokenizer's bos in front unless it is already there (or the tokenizer has none)."""
    bos = tokenizer.bos_token_id
    return ids if bos is None or (ids and ids[0] == bos) else [bos, *ids]


def prompt_response_segments(tokenizer: Any, prompt: str, response: str) -> list[tuple[list[int], bool]]:
    """``[(encode_prompt(prompt), False), (response ids + eos, True)]``."""
    response_ids = text_ids(tokenizer, response)
    if tokenizer.eos_token_id is not None:
        response_ids.append(tokenizer.eos_token_id)
    return [(encode_prompt(tokenizer, prompt), False), (response_ids, True)]


def tokenize_example(
    tokenizer: Any, prompt: str, response: str, max_length: int, overflow: str = "truncate"
) -> dict | None:
    """``input_ids`` = prompt ids (see ``encode_prompt``) + response ids + eos; ``labels`` = -100 on the prompt.

    Truncated on the right to ``max_length`` (the prompt start is kept), or dropped with ``overflow="skip"``.
    Returns ``None`` (skip the example) when no response token survives, so nothing is trained with zero
    loss tokens. ``assemble`` also reports which of these happened.
    """
    segments = prompt_response_segments(tokenizer, prompt, response)
    return assemble(segments, max_length, overflow)[0]


def pad_collate(batch: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids`` (with ``pad_id``) and ``labels`` (with -100); add ``attention_mask`` (0 on pads)."""
    width = max(len(ex["input_ids"]) for ex in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, ex in enumerate(batch):
        n = len(ex["input_ids"])
        input_ids[i, :n] = torch.as_tensor(ex["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.as_tensor(ex["labels"], dtype=torch.long)
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
