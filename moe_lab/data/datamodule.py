"""Lightning DataModule for supervised fine-tuning on instruction rows."""

from __future__ import annotations

import functools
import logging
import random
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from moe_lab.data.collate import pad_collate, tokenize_example
from moe_lab.data.llm_adapters import load_llm_adapters
from moe_lab.data.prompts import build_prompt
from moe_lab.data.synthetic import synthetic_math_rows

log = logging.getLogger(__name__)

SOURCES = ("synthetic", "llm_adapters")


class ListDataset(Dataset):
    """A map-style dataset over a Python list (works with DistributedSampler)."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> Any:
        return self.items[idx]


class SFTDataModule(L.LightningDataModule):
    """Train/val split of instruction rows, tokenized with prompt masking (see ``tokenize_example``).

    ``source="synthetic"`` generates ``num_examples`` (default 2000) rows; ``source="llm_adapters"`` reads
    ``path`` (file or hub id), capped at ``num_examples`` rows after a seeded shuffle. The split is
    deterministic given ``seed``; every DDP rank builds the same lists and Lightning shards them.
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
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"Unknown dataset source {source!r}; valid sources: {', '.join(SOURCES)}")
        if source == "llm_adapters" and not path:
            raise ValueError("source='llm_adapters' needs `path` (a .json/.jsonl file or a hub dataset id)")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.source, self.path, self.num_examples = source, path, num_examples
        self.val_fraction, self.max_length, self.batch_size = val_fraction, max_length, batch_size
        self.num_workers, self.seed, self.tokenizer = num_workers, seed, tokenizer
        self.rows: dict[str, list[dict]] = {}
        self.examples: dict[str, list[dict]] = {}
        self.num_skipped: dict[str, int] = {}

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Set (or replace) the tokenizer; call before ``setup``."""
        self.tokenizer = tokenizer
        self.examples = {}

    def load_rows(self) -> list[dict]:
        """All rows of the source (before splitting), capped at ``num_examples`` for files."""
        if self.source == "synthetic":
            return synthetic_math_rows(2000 if self.num_examples is None else self.num_examples, self.seed)
        rows = load_llm_adapters(self.path)
        random.Random(self.seed).shuffle(rows)
        return rows if self.num_examples is None else rows[: self.num_examples]

    def setup(self, stage: str | None = None) -> None:
        """Load rows, split train/val by ``seed`` and tokenize both splits (idempotent)."""
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
        val_idx = set(order[:n_val])
        self.rows = {
            "train": [r for i, r in enumerate(rows) if i not in val_idx],
            "val": [r for i, r in enumerate(rows) if i in val_idx],
        }
        for split, split_rows in self.rows.items():
            examples = [
                tokenize_example(
                    self.tokenizer, build_prompt(self.tokenizer, r), r["output"], self.max_length
                )
                for r in split_rows
            ]
            self.examples[split] = [ex for ex in examples if ex is not None]
            self.num_skipped[split] = len(examples) - len(self.examples[split])
            if split_rows and not self.examples[split]:
                raise ValueError(
                    f"All {len(split_rows)} {split} examples were skipped: no response token fits in "
                    f"max_length={self.max_length} (byte-level tokens are ~4x more than BPE tokens). "
                    "Raise dataset.max_length."
                )
            if self.num_skipped[split]:
                log.warning(
                    "%s: skipped %d/%d examples with no response token left after truncation to "
                    "max_length=%d",
                    split,
                    self.num_skipped[split],
                    len(examples),
                    self.max_length,
                )

    def gold_answers(self, split: str = "val") -> list[str | None]:
        """``answer`` of each row of ``split`` (all rows, including ones skipped by truncation)."""
        return [r.get("answer") for r in self.rows[split]]

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        pad_id = self.tokenizer.pad_token_id
        pad_id = self.tokenizer.eos_token_id if pad_id is None else pad_id
        return DataLoader(
            ListDataset(self.examples[split]),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.num_workers,
            collate_fn=functools.partial(pad_collate, pad_id=pad_id),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded) loader over the tokenized train split."""
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Loader over the tokenized val split, in order."""
        return self._loader("val", shuffle=False)
