"""task=compress: MoE -> dense conversion or expert pruning from one calibration file, perplexity, export."""

from __future__ import annotations

from omegaconf import DictConfig

from ..compress import run


def compress(cfg: DictConfig) -> dict:
    """:func:`moe_lab.compress.run.compress` on the composed config."""
    return run.compress(cfg)
