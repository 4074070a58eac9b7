"""task=finetune: train an MoE model with one method, then export a vanilla-loadable checkpoint."""

from __future__ import annotations

from omegaconf import DictConfig

from ..runtime import training


def finetune(cfg: DictConfig) -> dict:
    """:func:`moe_lab.runtime.training.finetune` on the composed config."""
    return training.finetune(cfg)
