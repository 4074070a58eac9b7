"""task=condense: CD-MoE (spec compression.md 3), LayerTrim or BlockTrim from one calibration file."""

from __future__ import annotations

from omegaconf import DictConfig

from ..compress import condense_run


def condense_task(cfg: DictConfig) -> dict:
    """:func:`moe_lab.compress.condense_run.condense_task` on the composed config."""
    return condense_run.condense_task(cfg)
