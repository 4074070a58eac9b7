"""The run behind task=calibrate (and the calibrate stage of multi-stage tasks): one streamed pass of the
unmodified model over calibration text, saved as one file."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..compress.calibration import calibrate
from ..core.atomic import atomic_write_json
from ..models import load_model

log = logging.getLogger(__name__)


def _positive(c, key: str) -> int:
    value = c.get(key)
    if value is None or int(value) <= 0:
        raise ValueError(f"compress.calibration.{key}={value} must be a positive integer")
    return int(value)


SAMPLES = ("random", "first", "documents")


def document_batches(dm, tokenizer, n: int, seq_len: int | None, batch_size: int) -> list[dict]:
    """[CD-code]'s calibration rows: the first ``n`` documents of a text dataset, one per row, BOS in front,
    truncated to ``seq_len`` tokens (None: whole documents), right-padded per batch with an attention mask."""
    from ..data.collate import text_ids, with_bos
    from ..data.sources import source_label, where

    docs = []
    for i, row in enumerate(dm._rows(dm.split, dm.streaming)):
        text = row.get(dm.text_field)
        if not isinstance(text, str):
            raise TypeError(f"{where(source_label(dm.path), i)}: field '{dm.text_field}' must be a string")
        if not text.strip():  # an empty line / document is no calibration row
            continue
        ids = with_bos(tokenizer, text_ids(tokenizer, text))
        docs.append(ids[:seq_len] if seq_len else ids)
        if len(docs) == n:
            break
    if len(docs) < n:
        raise ValueError(f"{source_label(dm.path)} has {len(docs)} non-empty documents, fewer than "
                         f"num_sequences={n}: lower it or add data")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    batches = []
    for start in range(0, n, batch_size):
        rows = docs[start:start + batch_size]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


def calibration_sequences(dataset_cfg: DictConfig, tokenizer, c) -> tuple[list[dict], str]:
    """Batches of calibration sequences from any ``conf/dataset`` entry, and a source label.

    Text datasets give ``num_sequences`` blocks of ``seq_len`` tokens (sampled with ``seed`` from the pool,
    or the first ones), or with ``sample=documents`` the first ``num_sequences`` documents one per row
    (:func:`document_batches`; ``seq_len`` null: untruncated); other datamodules give their first
    ``num_sequences`` training rows as they pad them.
    """
    if c.sample not in SAMPLES:
        raise ValueError(f"compress.calibration.sample={c.sample!r}: choose one of {', '.join(SAMPLES)}")
    untruncated = c.sample == "documents" and c.get("seq_len") is None
    n, batch_size = (_positive(c, k) for k in ("num_sequences", "batch_size"))
    seq_len = None if untruncated else _positive(c, "seq_len")
    no_val = {"val_split": None} if "val_split" in dataset_cfg else {}  # calibration reads training data only
    dm = instantiate(dataset_cfg, tokenizer=tokenizer, **no_val)
    label = f"{dataset_cfg.get('path')}"
    if dataset_cfg.get("name"):
        label += f" ({dataset_cfg.name})"
    if c.sample == "documents":
        if not hasattr(dm, "read_blocks"):
            raise ValueError(f"compress.calibration.sample=documents needs a text dataset (c4, wikitext103, ...); "
                             f"{label} is not one")
        batches = document_batches(dm, tokenizer, n, seq_len, batch_size)
        log.info("calibration sample=documents: the first %d documents of %s in file order, no random draw ([CD-code]'s "
                 "100 are its calibration_data.json: point the dataset's path at that file)", n, label)
        cut = "untruncated" if seq_len is None else f"truncated to {seq_len} tokens"
        return batches, label + f" split={dm.split}, first {n} documents, BOS, {cut}, batch {batch_size}, padded"
    if hasattr(dm, "read_blocks"):
        dm.block_size = seq_len
        pool = c.pool_blocks
        if c.sample == "first":
            pool = n
        elif pool is None and getattr(dm, "streaming", False):
            pool = 4 * n
        blocks = dm.read_blocks(dm.split, None if pool is None else int(pool))
        if len(blocks) < n:
            raise ValueError(f"{label} gives {len(blocks)} blocks of {seq_len} tokens, fewer than "
                             f"compress.calibration.num_sequences={n}: lower it (or seq_len), or add data")
        if c.sample == "random":
            blocks = blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(int(c.seed)))[:n]]
        else:
            blocks = blocks[:n]
        label += f" split={dm.split}, {n} x {seq_len}-token blocks, sample={c.sample}, seed={c.seed}"
        return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in blocks.split(batch_size)], label
    dm.setup("fit")
    batches, rows = [], 0
    for batch in dm.train_dataloader():
        take = min(n - rows, batch["input_ids"].shape[0])
        batches.append({k: batch[k][:take] for k in ("input_ids", "attention_mask")})
        rows += take
        if rows == n:
            break
    if rows < n:
        raise ValueError(f"{label} has {rows} training rows, fewer than compress.calibration.num_sequences={n}")
    return batches, label + f" train rows, first {n}"


def _readable_partial(partial: Path) -> Path | None:
    """The run's own partial calibration to continue (None: none). One that safetensors cannot open (truncated by
    a kill while it was copied, a full disk) is deleted and the calibration restarts from the first batch, said in
    one line: it is the run's own scratch file, and continuing it is impossible."""
    from safetensors import SafetensorError, safe_open

    if not partial.is_file():
        return None
    try:
        with safe_open(str(partial), framework="pt") as handle:
            handle.metadata()
    except (SafetensorError, OSError) as err:
        partial.unlink()
        log.warning("%s is truncated or corrupted (%s): deleted, the calibration restarts from the first batch",
                    partial, err)
        return None
    return partial


def calibrate_task(cfg: DictConfig) -> dict:
    """Calibrate ``cfg.model`` on ``cfg.compress.calibration.dataset``; write ``calibration.safetensors`` and ``summary.json``."""
    out = Path(cfg.paths.output_dir)
    c = cfg.compress.calibration
    model, tokenizer = load_model(cfg.model)
    batches, source = calibration_sequences(c.dataset, tokenizer, c)
    partial = out / "calibration.partial.safetensors"
    resume = c.resume_from or _readable_partial(partial)
    if resume is not None:
        log.info("resuming calibration from %s", resume)
    elif OmegaConf.select(cfg, "task.resume", default=None) and (out / "summary.json").is_file():
        log.warning("task.resume: this run's calibration finished (%s) and left no partial file: it is computed "
                    "again from the first batch", out / "summary.json")
    start = time.time()

    def progress(done: int, tokens: int) -> None:
        log.info("calibration: %d/%d batches, %d tokens, %.1f s", done, len(batches), tokens, time.time() - start)

    cal = calibrate(
        model, batches, max_chunk_tokens=int(c.max_chunk_tokens), memory_budget_mb=float(c.memory_budget_mb),
        progress=progress, resume_from=resume, partial_path=partial, save_every=int(c.save_every),
        data_source=source, manifest_extra={"model_config": cfg.model.name},
    )
    path = cal.save(c.output or out / "calibration.safetensors")
    partial.unlink(missing_ok=True)
    summary = {"calibration": str(path), "model": cal.manifest["model"], "tokens": cal.manifest["tokens"],
               "num_sequences": cal.manifest["num_sequences"], "moe_layers": cal.manifest["moe_layers"],
               "data": cal.manifest["data"], "wall_time_s": round(time.time() - start, 1)}
    atomic_write_json(out / "summary.json", summary, indent=2)
    print(f"==== moe-lab calibrate: {cal.manifest['tokens']} tokens, {len(cal.layers)} MoE layers -> {path}",
          flush=True)
    return summary
