"""Plain text as fixed-length token blocks, for distillation and calibration (FineWeb-Edu, C4, WikiText).

Documents are tokenized without special tokens, each followed by a separator (the eos token by default, or
a string such as ``"\\n\\n"``), concatenated and cut into blocks of exactly ``block_size`` tokens (the last
partial block is dropped). A block is all real tokens: ``labels == input_ids`` and ``attention_mask`` is
all ones. ``streaming=True`` reads a hub dataset as a stream (``datasets`` streaming, documents sharded
across data-parallel ranks by index) and needs ``num_blocks``; ``streaming=False`` reads everything (or the
first ``num_blocks`` blocks) into memory once. Both train loaders are resumable mid-epoch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from moe_lab.data.collate import text_ids
from moe_lab.data.resumable import ResumableDataLoader, ResumableDataModule, ResumableSampler
from moe_lab.data.sources import is_local, source_label, stream_rows, where

log = logging.getLogger(__name__)


def document_ids(tokenizer: Any, rows: Iterable[dict], text_field: str, separator: str, source: str,
                 shard: tuple[int, int] = (0, 1)) -> Iterator[list[int]]:
    """Token ids of each document (row ``i`` with ``i % world == rank`` for ``shard=(rank, world)``), followed
    by the separator: ``"eos"`` (the eos token), ``""`` (nothing) or any text."""
    rank, world = shard
    sep_ids: list[int] = []
    if separator == "eos":
        if tokenizer.eos_token_id is None:
            raise ValueError("dataset.separator=eos but the tokenizer has no eos token; set a text separator")
        sep_ids = [tokenizer.eos_token_id]
    for i, row in enumerate(rows):
        if i % world != rank:
            continue
        text = row.get(text_field)
        if text is None:
            raise ValueError(f"{where(source, i)}: required field '{text_field}' is missing (or null)")
        if not isinstance(text, str):
            raise TypeError(f"{where(source, i)}: field '{text_field}' must be a string, got {text!r:.200}")
        yield text_ids(tokenizer, text + separator) if separator != "eos" else text_ids(tokenizer, text) + sep_ids


def token_blocks(documents: Iterable[list[int]], block_size: int, limit: int | None = None) -> Iterator[list[int]]:
    """Consecutive ``block_size``-token blocks of the concatenated documents (at most ``limit`` of them)."""
    if limit is not None and limit <= 0:
        return
    buffer: list[int] = []
    made = 0
    for ids in documents:
        buffer.extend(ids)
        while len(buffer) >= block_size:
            yield buffer[:block_size]
            del buffer[:block_size]
            made += 1
            if limit is not None and made >= limit:
                return


def block_batch(blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack blocks into ``input_ids``/``labels`` (equal) and an all-ones ``attention_mask``."""
    ids = torch.stack([b[0] if isinstance(b, tuple | list) else b for b in blocks])
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


class TextBlockStream(IterableDataset):
    """``num_blocks`` blocks of one rank's share of a document stream; ``len()`` is ``num_blocks``."""

    def __init__(self, rows: Callable[[], Iterable[dict]], tokenizer: Any, text_field: str, separator: str,
                 block_size: int, num_blocks: int, source: str, shard: tuple[int, int] = (0, 1)) -> None:
        self.rows, self.tokenizer, self.text_field, self.separator = rows, tokenizer, text_field, separator
        self.block_size, self.num_blocks, self.source, self.shard = block_size, num_blocks, source, shard

    def __len__(self) -> int:
        return self.num_blocks

    def __iter__(self) -> Iterator[torch.Tensor]:
        documents = document_ids(self.tokenizer, self.rows(), self.text_field, self.separator, self.source, self.shard)
        made = 0
        for block in token_blocks(documents, self.block_size, self.num_blocks):
            made += 1
            yield torch.tensor(block, dtype=torch.long)
        if made < self.num_blocks:
            log.warning("%s ran out after %d of %d blocks on rank %d; lower dataset.num_blocks so every "
                        "data-parallel rank gets the same number of batches", self.source, made, self.num_blocks,
                        self.shard[0])


class TextBlockDataModule(ResumableDataModule):
    """Fixed-length token blocks from a text dataset (hub id, URL, or a local ``.txt``/``.jsonl``/``.parquet``).

    ``num_blocks`` counts train blocks over all data-parallel ranks (each rank gets ``num_blocks // world``);
    ``val_split`` (with ``val_blocks``, ``None`` = all; read from ``val_path``, default ``path``) adds a
    validation loader, else there is none.
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        split: str = "train",
        text_field: str = "text",
        block_size: int = 2048,
        batch_size: int = 8,
        num_blocks: int | None = None,
        streaming: bool = True,
        separator: str = "eos",
        shuffle: bool = False,
        val_split: str | None = None,
        val_blocks: int | None = None,
        val_path: str | None = None,
        seed: int = 0,
        num_workers: int = 0,
        tokenizer: Any = None,
    ) -> None:
        super().__init__()
        if not path:
            raise ValueError("TextBlockDataModule needs `path` (a hub dataset id, a URL or a local text file)")
        if streaming and num_blocks is None:
            raise ValueError("A streamed dataset has no length: set dataset.num_blocks (train blocks over all "
                             "ranks), or dataset.streaming=false to read it whole")
        if streaming and num_workers:
            raise ValueError("A streamed text dataset is read in the main process: set dataset.num_workers=0 "
                             "(or dataset.streaming=false to use workers)")
        if val_split and val_path is None and is_local(path) and os.path.isfile(os.path.expanduser(path)):
            raise ValueError(f"dataset.path={path!r} is a single file, so it has no {val_split!r} split: set "
                             "dataset.val_path=/local/validation_file (or dataset.val_split=null)")
        if streaming and shuffle:
            raise ValueError("dataset.shuffle needs dataset.streaming=false (a stream is read in order)")
        self.path, self.name, self.split, self.text_field = path, name, split, text_field
        self.block_size, self.batch_size, self.num_blocks = block_size, batch_size, num_blocks
        self.streaming, self.separator, self.shuffle = streaming, separator, shuffle
        self.val_split, self.val_blocks, self.val_path, self.seed = val_split, val_blocks, val_path, seed
        self.num_workers, self.tokenizer = num_workers, tokenizer
        self.blocks: dict[str, torch.Tensor] = {}

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Set (or replace) the tokenizer; call before ``setup``."""
        self.tokenizer, self.blocks = tokenizer, {}

    def _rows(self, split: str, streaming: bool, path: str | None = None) -> Iterator[dict]:
        return stream_rows(path or self.path, split=split, name=self.name, streaming=streaming,
                           example="/local/file.txt")

    def read_blocks(self, split: str, limit: int | None, path: str | None = None) -> torch.Tensor:
        """``[n, block_size]`` int64 blocks of ``split`` (of ``path``, default ``self.path``) in order, at most
        ``limit``."""
        path = path or self.path
        documents = document_ids(self.tokenizer, self._rows(split, self.streaming, path), self.text_field,
                                 self.separator, source_label(path))
        blocks = list(token_blocks(documents, self.block_size, limit))
        if not blocks:
            raise ValueError(f"{source_label(path)} (split {split!r}) has fewer than block_size="
                             f"{self.block_size} tokens: lower dataset.block_size")
        return torch.tensor(blocks, dtype=torch.long)

    def setup(self, stage: str | None = None) -> None:
        """Read the in-memory splits (train unless streamed, val if ``val_split``); idempotent."""
        if self.tokenizer is None:
            raise ValueError("TextBlockDataModule needs a tokenizer: pass tokenizer=... or call set_tokenizer(tok)")
        if not self.streaming and "train" not in self.blocks:
            self.blocks["train"] = self.read_blocks(self.split, self.num_blocks)
            log.info("train: %d blocks of %d tokens from %s", len(self.blocks["train"]), self.block_size, self.path)
        if self.val_split and "val" not in self.blocks:
            self.blocks["val"] = self.read_blocks(self.val_split, self.val_blocks, self.val_path)

    def train_dataloader(self) -> ResumableDataLoader:
        """Blocks in order (or shuffled by ``seed + epoch``), this rank's share; resumable mid-epoch."""
        num_replicas, rank = self.data_parallel_shard()
        if self.streaming:
            per_rank = self.num_blocks // num_replicas
            if per_rank == 0:
                raise ValueError(f"dataset.num_blocks={self.num_blocks} gives no block to each of {num_replicas} ranks")
            stream = TextBlockStream(lambda: self._rows(self.split, True), self.tokenizer, self.text_field,
                                     self.separator, self.block_size, per_rank, source_label(self.path),
                                     shard=(rank, num_replicas))
            loader = ResumableDataLoader(stream, batch_size=self.batch_size, collate_fn=block_batch)
        else:
            dataset = TensorDataset(self.blocks["train"])
            sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=self.shuffle,
                                       seed=self.seed)
            loader = ResumableDataLoader(dataset, batch_size=self.batch_size, sampler=sampler,
                                         num_workers=self.num_workers, collate_fn=block_batch,
                                         persistent_workers=self.num_workers > 0)
        return self.track_train_loader(loader)

    def val_dataloader(self) -> DataLoader | list:
        """Validation blocks in order, or ``[]`` (no validation) without ``val_split``."""
        if "val" not in self.blocks:
            return []
        return DataLoader(TensorDataset(self.blocks["val"]), batch_size=self.batch_size, collate_fn=block_batch)
