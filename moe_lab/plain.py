"""Turn OmegaConf nodes into plain Python containers (anything else passes through)."""

from __future__ import annotations


def to_plain(value):
    """``OmegaConf.to_container(value, resolve=True)`` for config nodes; ``value`` unchanged otherwise."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
