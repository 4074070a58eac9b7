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
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def tokenize_example(tokenizer: Any, prompt: str, response: str, max_length: int) -> dict | None:
    """``input_ids`` = prompt ids (see ``encode_prompt``) + response ids + eos; ``labels`` = -100 on the prompt.

    Truncated on the right to ``max_length`` (the prompt start is kept). Returns ``None`` (skip the example)
    when no response token survives truncation, so nothing is trained with zero loss tokens.
    """
    prompt_ids = encode_prompt(tokenizer, prompt)
    response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        response_ids.append(tokenizer.eos_token_id)
    input_ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
    if all(label == IGNORE_INDEX for label in labels):
        return None
    return {"input_ids": input_ids, "labels": labels}


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
