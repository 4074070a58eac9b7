"""task=calibrate: one streamed pass of the unmodified model over calibration text, saved as one file."""

from __future__ import annotations

from omegaconf import DictConfig

from ..compress import calibrate_run


def calibrate_task(cfg: DictConfig) -> dict:
    """:func:`moe_lab.compress.calibrate_run.calibrate_task` on the composed config."""
    return calibrate_run.calibrate_task(cfg)
