"""The method registry: ``moe_lab.apply(model, method, **options)``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

from torch import nn

from ..moe.block import MoEBlock
from ..moe.patch import MoEPatch
from .compressed_experts import CONFIG_FILE as COMPRESSED_EXPERTS_CONFIG
from .compressed_experts import install_compressed_experts, load_compressed_experts
from .condenser import STATE_FILE as CONDENSER_STATE
from .condenser import install_condenser, load_condenser
from .densemixer import install_densemixer
from .esft import install_esft
from .lora import add_lora
from .sft import install_frozen_router, install_sft

METHODS: dict[str, Callable] = {
    "sft": install_sft,
    "frozen_router": install_frozen_router,
    "densemixer": install_densemixer,
    "esft": install_esft,
    "compressed_experts": install_compressed_experts,
    "condenser": install_condenser,
}

# Hydra method names (conf/method/<name>.yaml) that train any causal LM, dense or MoE: models.load_model loads a
# dense model (a model_type outside moe/registry.py's families, e.g. a to_dense export) only for these
DENSE_METHODS: tuple[str, ...] = ("kd",)


# files a method writes beside an export -> the loader that re-installs that method on the vanilla model
EXPORT_LOADERS: dict[str, Callable] = {
    CONDENSER_STATE: load_condenser,
    COMPRESSED_EXPERTS_CONFIG: load_compressed_experts,
}


def install_exported_routing(model: nn.Module, directory: str | Path) -> MoEPatch | None:
    """Re-install the moe-lab routing an export carries beside its vanilla weights (vanilla HF cannot express
    it); returns the patch, or None for an export with plain HF routing."""
    for filename, load in EXPORT_LOADERS.items():
        if (Path(directory) / filename).is_file():
            return load(model, directory)
    return None


def supported_methods() -> list[str]:
    """Names accepted by :func:`apply`."""
    return sorted(METHODS)


def apply(model: nn.Module, method: str = "sft", lora: dict | None = None, **options) -> MoEPatch:
    """Install moe-lab MoE blocks into a loaded HF MoE model in place and set up ``method``.

    ``lora`` (rank, alpha, dropout, targets, train_router; see :mod:`moe_lab.methods.lora`) adds
    adapters on top of any method. Returns the :class:`MoEPatch` (``.layers``, ``.export()``, ``.remove()``).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(supported_methods())}")
    if any(isinstance(m, MoEBlock) for m in model.modules()):
        raise ValueError("this model already has moe-lab blocks installed: call patch.remove() first")
    installer = METHODS[method]
    accepted = set(inspect.signature(installer).parameters) - {"patch"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"method {method!r} got unknown option(s) {unknown}; it accepts {sorted(accepted) or 'none'}"
        )
    base_parameters = {id(p) for p in model.parameters()}
    patch = MoEPatch(model, method=method)
    installer(patch, **options)
    if lora:
        accepted = set(inspect.signature(add_lora).parameters) - {"patch", "base_parameters"}
        bad = sorted(set(lora) - accepted)
        if bad:
            raise TypeError(f"lora got unknown option(s) {bad}; it accepts {sorted(accepted)}")
        add_lora(patch, base_parameters, **lora)
    return patch
