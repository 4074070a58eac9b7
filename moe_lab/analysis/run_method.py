"""Which method trained a run, read from the run's own record, and whether that method computes every expert on
every token (DenseMixer: its router gradient needs all E expert outputs), which the analyses then count."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf


def trained_method(run_dir: str | Path) -> str | None:
    """``method.name`` of the task=finetune run whose directory is ``run_dir`` (its ``config.yaml``), if recorded."""
    config = Path(run_dir) / "config.yaml"
    return OmegaConf.select(OmegaConf.load(config), "method.name") if config.is_file() else None


def computes_every_expert(method: str | None) -> bool:
    """DenseMixer and its variants (``densemixer``, ``densemixer_lora``, ...) run all E experts on every token."""
    return bool(method) and str(method).startswith("densemixer")
