"""Shared helpers for the callback tests: tiny patched models, a minimal LightningModule, batches."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning as L
import torch
import transformers
from omegaconf import OmegaConf

import moe_lab
from moe_lab.models import build_config

REPO = Path(__file__).resolve().parents[2]


def tiny_model(name: str = "tiny_olmoe", seed: int = 0):
    cfg = OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(build_config(cfg.config_class, cfg.config))
    return model, moe_lab.apply(model, "sft")


class TinyModule(L.LightningModule):
    """The smallest module the callbacks need: ``self.model``, ``self.patch`` and a causal-LM loss."""

    def __init__(self, name: str = "tiny_olmoe", lr: float = 1e-3):
        super().__init__()
        self.model, self.patch = tiny_model(name)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss
        self.log("train/loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def random_batches(n: int, batch: int = 2, seq: int = 12, seed: int = 0) -> list[dict]:
    """Random token batches (ids 3..299) whose last row is right-padded (pad id 0, mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 300, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        pad = int(torch.randint(2, seq // 2, (1,), generator=g))
        mask[-1, seq - pad :] = 0
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def loader(batches):
    return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)


def read_csv_metrics(path) -> list[dict[str, float]]:
    """Rows of a Lightning metrics.csv as {column: float} with empty cells dropped."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append({k: float(v) for k, v in row.items() if v not in ("", None)})
    return rows


def metric_by_step(rows, key) -> dict[int, float]:
    """{step: value} of one metric; fails if a step carries the metric twice (a stale re-log)."""
    out: dict[int, float] = {}
    for row in rows:
        if key in row:
            step = int(row["step"])
            assert step not in out, f"{key} logged twice at step {step}"
            out[step] = row[key]
    return out


def ref_load_stats(counts) -> dict[str, float]:
    """Expert-load statistics from first principles (pure Python), independent of moe_lab.analysis."""
    x = [float(c) for c in counts]
    e, total = len(x), sum(x)
    mean = total / e
    p = [c / total for c in x]
    pair = sum(abs(a - b) for a in x for b in x)
    h = -sum(q * math.log(q) for q in p if q > 0)
    return {
        "imbalance": max(x) / mean,
        "gini": pair / (2 * e * e * mean),
        "entropy": h,
        "entropy_norm": h / math.log(e),
    }
