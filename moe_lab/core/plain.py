"""Turn OmegaConf nodes into plain Python containers (anything else passes through); flatten nested settings."""

from __future__ import annotations


def to_plain(value):
    """``OmegaConf.to_container(value, resolve=True)`` for config nodes; ``value`` unchanged otherwise."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def flatten(settings: dict, prefix: str = "") -> dict:
    """``{"generation": {"max_new_tokens": 8}}`` -> ``{"generation.max_new_tokens": 8}``."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
