"""Lightning DataModule for supervised fine-tuning on instruction, chat and reasoning rows."""

from __future__ import annotations

import functools
import logging
import random
from collections import Counter
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader, Dataset

from moe_lab.data.chat import CHAT_FORMATS, chat_segments, validate_chat_rows
from moe_lab.data.collate import assemble, check_overflow, pad_collate, prompt_response_segments
from moe_lab.data.llm_adapters import load_llm_adapters
from moe_lab.data.packing import pack_examples, packed_collate
from moe_lab.data.prompts import build_prompt
from moe_lab.data.reasoning import reasoning_format, reasoning_rows
from moe_lab.data.resumable import ResumableDataLoader, ResumableDataModule, ResumableSampler
from moe_lab.data.sources import read_rows, source_label
from moe_lab.data.synthetic import synthetic_math_rows

log = logging.getLogger(__name__)

#: ``synthetic``: generated arithmetic problems; ``llm_adapters``: instruction/input/output/answer rows
#: (LLM-Adapters, MathInstruct); ``chat``: rows with ``messages`` (ESFT, Tulu 3); ``reasoning``: question +
#: thinking trace + answer (s1K), trained as a chat conversation.
SOURCES = ("synthetic", "llm_adapters", "chat", "reasoning")


class ListDataset(Dataset):
    """A map-style dataset over a Python list (works with DistributedSampler)."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> Any:
        return self.items[idx]


class SFTDataModule(ResumableDataModule):
    """Train/val split of rows, tokenized with the loss on responses only.

    ``source`` picks the row format (``SOURCES``); ``path`` is a local file or folder, a URL or a hub id
    (``name``/``split`` for hub datasets), capped at ``num_examples`` rows after a seeded shuffle.
    Examples longer than ``max_length`` follow ``overflow``: ``truncate`` (cut the end; dropped only if no
    response token is left) or ``skip`` (drop); counts are logged and kept in ``overflow_counts``.
    ``packing=True`` packs the train split into rows of ``max_length`` tokens (``moe_lab.data.packing``; call
    the model with ``model_inputs(batch)``); validation stays unpacked. The train loader is resumable
    mid-epoch (``moe_lab.data.resumable``) and shards across data-parallel ranks itself. The split is
    deterministic given ``seed``; every rank builds the same lists.
    """

    def __init__(
        self,
        source: str,
        path: str | None = None,
        num_examples: int | None = None,
        val_fraction: float = 0.05,
        max_length: int = 256,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
        tokenizer: Any = None,
        name: str | None = None,
        split: str = "train",
        overflow: str = "truncate",
        packing: bool = False,
        chat_format: str = "auto",
        messages_field: str = "messages",
        reasoning: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"Unknown dataset source {source!r}; valid sources: {', '.join(SOURCES)}")
        if source != "synthetic" and not path:
            raise ValueError(f"source={source!r} needs `path` (a local file or folder, a URL or a hub dataset id)")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if chat_format not in CHAT_FORMATS:
            raise ValueError(f"dataset.chat_format must be one of {', '.join(CHAT_FORMATS)}, got {chat_format!r}")
        self.source, self.path, self.num_examples = source, path, num_examples
        self.name, self.split = name, split
        self.val_fraction, self.max_length, self.batch_size = val_fraction, max_length, batch_size
        self.num_workers, self.seed, self.tokenizer = num_workers, seed, tokenizer
        self.overflow, self.packing = check_overflow(overflow), bool(packing)
        self.chat_format, self.messages_field = chat_format, messages_field
        self.reasoning = reasoning_format(reasoning)
        self.rows: dict[str, list[dict]] = {}
        self.examples: dict[str, list[dict]] = {}
        self.packed_rows: list[list[dict]] = []
        self.num_skipped: dict[str, int] = {}
        self.overflow_counts: dict[str, Counter] = {}

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Set (or replace) the tokenizer; call before ``setup``."""
        self.tokenizer = tokenizer
        self.examples = {}

    def load_rows(self) -> list[dict]:
        """All rows of the source (before splitting), validated, capped at ``num_examples`` for files."""
        if self.source == "synthetic":
            return synthetic_math_rows(2000 if self.num_examples is None else self.num_examples, self.seed)
        if self.source == "llm_adapters":
            rows = load_llm_adapters(self.path, split=self.split, name=self.name)
        else:
            raw = read_rows(self.path, split=self.split, name=self.name)
            label = source_label(self.path)
            if self.source == "chat":
                rows = validate_chat_rows(raw, label, self.messages_field)
            else:
                rows = reasoning_rows(raw, label, self.reasoning)
        random.Random(self.seed).shuffle(rows)
        return rows if self.num_examples is None else rows[: self.num_examples]

    def segments(self, row: Mapping[str, Any]) -> list[tuple[list[int], bool]]:
        """``(token ids, trained)`` pieces of one row (see ``assemble``)."""
        if self.source in ("chat", "reasoning"):
            return chat_segments(self.tokenizer, row["messages"], self.chat_format)
        return prompt_response_segments(self.tokenizer, build_prompt(self.tokenizer, row), row["output"])

    def setup(self, stage: str | None = None) -> None:
        """Load rows, split train/val by ``seed``, tokenize both splits and pack train if asked (idempotent)."""
        if self.examples:
            return
        if self.tokenizer is None:
            raise ValueError("SFTDataModule needs a tokenizer: pass tokenizer=... or call set_tokenizer(tok)")
        rows = self.load_rows()
        order = list(range(len(rows)))
        random.Random(self.seed + 1).shuffle(order)
        n_val = 0
        if self.val_fraction > 0 and len(rows) > 1:  # at least one row on each side
            n_val = min(max(round(len(rows) * self.val_fraction), 1), len(rows) - 1)
        elif self.val_fraction > 0:
            log.warning("dataset %s has %d row: dataset.val_fraction=%g leaves no validation row (it needs 2 rows), "
                        "so no validation runs; add rows or set dataset.val_fraction=0", self.path, len(rows),
                        self.val_fraction)
        val_idx = set(order[:n_val])
        self.rows = {
            "train": [r for i, r in enumerate(rows) if i not in val_idx],
            "val": [r for i, r in enumerate(rows) if i in val_idx],
        }
        for split, split_rows in self.rows.items():
            self.examples[split] = self._tokenize_split(split, split_rows)
        if self.packing:
            bins = pack_examples([len(ex["input_ids"]) for ex in self.examples["train"]], self.max_length)
            self.packed_rows = [[self.examples["train"][i] for i in b] for b in bins]
            tokens = sum(len(ex["input_ids"]) for ex in self.examples["train"])
            log.info("train: packed %d examples into %d rows of max_length=%d (%.1f%% of row tokens used)",
                     len(self.examples["train"]), len(bins), self.max_length,
                     100.0 * tokens / max(1, len(bins) * self.max_length))

    def _tokenize_split(self, split: str, split_rows: list[dict]) -> list[dict]:
        counts: Counter = Counter()
        examples = []
        for row in split_rows:
            example, outcome = assemble(self.segments(row), self.max_length, self.overflow)
            counts[outcome] += 1
            if example is not None:
                examples.append(example)
        self.overflow_counts[split] = counts
        self.num_skipped[split] = counts["too_long"] + counts["no_labels"]
        if split_rows and not examples:
            raise ValueError(
                f"All {len(split_rows)} {split} examples were dropped ({counts['too_long']} longer than "
                f"max_length={self.max_length} with overflow={self.overflow}, {counts['no_labels']} with no "
                "response token left after truncation; byte-level tokens are ~4x more than BPE tokens). "
                "Raise dataset.max_length."
            )
        if split_rows:
            level = logging.WARNING if counts["truncated"] or self.num_skipped[split] else logging.INFO
            log.log(level, "%s: %d examples, overflow=%s at max_length=%d: %d kept whole, %d truncated, "
                    "%d dropped as too long, %d dropped with no response token left", split, len(split_rows),
                    self.overflow, self.max_length, counts["kept"], counts["truncated"], counts["too_long"],
                    counts["no_labels"])
        return examples

    def gold_answers(self, split: str = "val") -> list[str | None]:
        """``answer`` of each row of ``split`` (all rows, including ones dropped by the overflow policy)."""
        return [r.get("answer") for r in self.rows[split]]

    def _pad_id(self) -> int:
        pad_id = self.tokenizer.pad_token_id
        return self.tokenizer.eos_token_id if pad_id is None else pad_id

    def train_dataloader(self) -> ResumableDataLoader:
        """Shuffled (``seed + epoch``) loader over this rank's share of the train split; resumable mid-epoch."""
        if self.packing:
            dataset, collate = ListDataset(self.packed_rows), packed_collate
        else:
            dataset, collate = ListDataset(self.examples["train"]), pad_collate
        num_replicas, rank = self.data_parallel_shard()
        return self.track_train_loader(ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=self.seed),
            num_workers=self.num_workers,
            collate_fn=functools.partial(collate, pad_id=self._pad_id()),
            persistent_workers=self.num_workers > 0,
        ))

    def val_dataloader(self) -> DataLoader:
        """Loader over the tokenized val split, in order (unpacked)."""
        return DataLoader(
            ListDataset(self.examples["val"]),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=functools.partial(pad_collate, pad_id=self._pad_id()),
            persistent_workers=self.num_workers > 0,
        )
