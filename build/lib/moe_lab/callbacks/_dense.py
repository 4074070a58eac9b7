"""The guard of the callbacks that read MoE layers, for a model without any (a dense student of method=kd)."""

from __future__ import annotations

import logging

import lightning.pytorch as pl

log = logging.getLogger("moe_lab.callbacks")


def without_moe_layers(callback: pl.Callback, pl_module: pl.LightningModule) -> bool:
    """True when ``pl_module.patch`` has no MoE layers (a dense model); then logs, once per callback instance,
    ``no MoE layers in <model_type>: <callback> does nothing``. A module without a ``patch`` is not judged
    here (False): the callback's own error names what it needs."""
    patch = getattr(pl_module, "patch", None)
    if patch is None or list(getattr(patch, "layers", None) or []):
        return False
    if not getattr(callback, "_dense_noted", False):
        model = getattr(pl_module, "model", None)
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        log.info("no MoE layers in %s: %s does nothing", model_type, type(callback).__name__)
        callback._dense_noted = True
    return True
