"""task=evaluate: score a model on an ``eval=`` group and write the papers' results table."""

from __future__ import annotations

from omegaconf import DictConfig

from ..eval import run


def evaluate(cfg: DictConfig) -> dict:
    """:func:`moe_lab.eval.run.evaluate` on the composed config."""
    return run.evaluate(cfg)
