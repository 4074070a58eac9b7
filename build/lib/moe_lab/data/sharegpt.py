"""ShareGPT-style rows (``conversations``: ``[{"from": ..., "value": ...}]``) as chat conversations.

The layout LLaMA-Factory calls ``sharegpt`` (DenseMixer's public code ships its Qwen3 training sets this way:
``data/dataset_info.json``, columns ``messages: conversations``, tags ``from``/``value``). Each turn becomes a
``{"role", "content"}`` message and the conversation goes through ``moe_lab.data.chat`` (loss on assistant
turns only; ``dataset.chat_format`` picks the tokenizer's template or the plain format).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from moe_lab.data.chat import validate_chat_row
from moe_lab.data.datamodule import SFTDataModule
from moe_lab.data.sources import read_rows, source_label

#: ``from`` tag -> chat role (LLaMA-Factory's sharegpt tags and the original human/gpt ones).
ROLE_TAGS = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}


def sharegpt_messages(row: Mapping[str, Any], source: str, i: int, field: str = "conversations") -> list[dict]:
    """The row's turns as validated chat messages; a malformed turn raises naming row/line/field."""
    return validate_chat_row(row, source, i, field, keys=("from", "value"), roles=ROLE_TAGS)


class ShareGPTDataModule(SFTDataModule):
    """:class:`SFTDataModule` with ``source=chat`` over ShareGPT rows (``conversations_field`` holds the turns)."""

    def __init__(self, path: str, conversations_field: str = "conversations", **kwargs: Any) -> None:
        super().__init__(source="chat", path=path, **kwargs)
        self.conversations_field = conversations_field

    def load_rows(self) -> list[dict]:
        label = source_label(self.path)
        rows = [{**row, "messages": sharegpt_messages(row, label, i, self.conversations_field)}
                for i, row in enumerate(read_rows(self.path, split=self.split, name=self.name))]
        random.Random(self.seed).shuffle(rows)
        return rows if self.num_examples is None else rows[: self.num_examples]
