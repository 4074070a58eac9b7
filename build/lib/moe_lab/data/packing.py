"""Sequence packing for SFT: several tokenized examples per row, with no attention across examples.

A packed row concatenates whole examples (best-fit decreasing into rows of at most ``max_length``
tokens; an example is never split). ``position_ids`` restart at 0 for every example, and each example's
first label is -100 (in an unpacked row nothing predicts the first token; packed, the previous example's
last token would). transformers v5 turns restarting ``position_ids`` into a block-diagonal causal mask
(``masking_utils.find_packed_sequence_indices``) for eager, sdpa and flex attention, and flash attention
reads them as variable-length sequences, but only when the model gets ``attention_mask=None`` and no
cache: a 2-D ``attention_mask`` is read as a padding mask and ``use_cache=True`` (the default of most
configs) disables the detection, both silently letting examples attend to each other.

Not every model forwards ``position_ids`` to its mask builder (transformers 5.23's GPT-OSS does not, so it
would attend across examples): ``verify_packing(model)`` checks a model with one short forward pass.

So a packed batch has no ``attention_mask`` key. It holds ``input_ids``, ``labels``, ``position_ids`` and
``token_mask`` (1 on the examples' tokens, 0 on the trailing pad that fills a row to the batch width; the pad
gets its own position run, so it is a separate block). Call the model with ``model_inputs(batch)`` and count
real tokens with ``real_token_mask(batch)``; both also accept an ordinary padded batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from moe_lab.data.collate import IGNORE_INDEX


def pack_examples(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Best-fit decreasing: indices of the examples in each row; every row holds at most ``max_length`` tokens.

    Deterministic: longer examples first (ties by index), each into the fullest row it still fits in. Rows
    are returned in creation order and hold their examples longest first.
    """
    if any(n > max_length for n in lengths):
        raise ValueError(f"An example is longer than the pack length max_length={max_length}; truncate or skip it first")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row index), sorted
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        pos = bisect.bisect_left(free, (lengths[i], -1))
        if pos == len(free):
            rows.append([i])
            bisect.insort(free, (max_length - lengths[i], len(rows) - 1))
            continue
        room, row = free.pop(pos)
        rows[row].append(i)
        bisect.insort(free, (room - lengths[i], row))
    return rows


class PackedBatch(dict):
    """The dict ``packed_collate`` returns; asking it for a key it lacks (``attention_mask``) says why."""

    def __missing__(self, key: str):
        raise KeyError(
            f"{key!r}: this is a packed batch (dataset.packing=true), which has no attention_mask on purpose. "
            "Call the model with moe_lab.data.model_inputs(batch) and count tokens with real_token_mask(batch)."
        )


def packed_collate(batch: Sequence[Sequence[dict]], pad_id: int) -> PackedBatch:
    """Packed rows (each a list of ``{"input_ids", "labels"}`` examples) -> a right-padded packed batch.

    ``position_ids`` count 0, 1, ... within each example and again within the trailing pad; ``labels`` are
    -100 on each example's first token and on the pad; ``token_mask`` is 0 only on the pad.
    """
    width = max(sum(len(ex["input_ids"]) for ex in row) for row in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(batch), width), dtype=torch.long)
    token_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, row in enumerate(batch):
        start = 0
        for ex in row:
            n = len(ex["input_ids"])
            input_ids[r, start : start + n] = torch.as_tensor(ex["input_ids"], dtype=torch.long)
            labels[r, start + 1 : start + n] = torch.as_tensor(ex["labels"][1:], dtype=torch.long)
            position_ids[r, start : start + n] = torch.arange(n)
            token_mask[r, start : start + n] = 1
            start += n
        position_ids[r, start:] = torch.arange(width - start)
    return PackedBatch(input_ids=input_ids, labels=labels, position_ids=position_ids, token_mask=token_mask)


def is_packed(batch: dict) -> bool:
    """Whether ``batch`` came from ``packed_collate`` (it carries ``position_ids`` and no ``attention_mask``)."""
    return "position_ids" in batch and "attention_mask" not in batch


def model_inputs(batch: dict) -> dict:
    """Keyword arguments for an HF causal LM: packed -> ``position_ids``, ``attention_mask=None``,
    ``use_cache=False`` (so transformers builds the block-diagonal mask); padded -> ``attention_mask``."""
    if is_packed(batch):
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "labels": batch["labels"],
                "attention_mask": None, "use_cache": False}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": batch["labels"]}


def real_token_mask(batch: dict) -> torch.Tensor:
    """1 on real tokens, 0 on padding, for a packed or a padded batch."""
    return batch["token_mask"] if is_packed(batch) else batch["attention_mask"]


def verify_packing(model: torch.nn.Module, atol: float = 1e-4) -> None:
    """Raise unless ``model`` keeps packed examples apart: the logits of a 5-token sequence packed after a
    4-token one (``model_inputs`` of a packed batch) must equal its logits alone. One no-grad forward in
    eval mode; the training flag is restored."""
    param = next(model.parameters())
    vocab = int(getattr(model.config, "vocab_size", 64))
    first, second = [1, 5, 6, 7], [1, 8, 9, 10, 11]
    first, second = [t % vocab for t in first], [t % vocab for t in second]
    batch = packed_collate([[{"input_ids": first, "labels": first}, {"input_ids": second, "labels": second}]], 0)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            inputs = {k: v.to(param.device) if torch.is_tensor(v) else v for k, v in model_inputs(batch).items()}
            packed = model(**inputs).logits[0, len(first):].float()
            alone = model(input_ids=torch.tensor([second], device=param.device), use_cache=False).logits[0].float()
    finally:
        model.train(was_training)
    gap = float((packed - alone).abs().max())
    if gap > atol:
        raise ValueError(
            f"{type(model).__name__} attends across packed examples (logits differ by {gap:.3g}): its transformers "
            "implementation does not build the packed-sequence mask from position_ids. Use dataset.packing=false."
        )
