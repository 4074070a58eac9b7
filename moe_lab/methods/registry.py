"""The method registry: ``moe_lab.apply(model, method, **options)``."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

from ..moe.block import MoEBlock
from ..moe.patch import MoEPatch
from .condenser import install_condenser
from .densemixer import install_densemixer
from .sft import install_frozen_router, install_sft

METHODS: dict[str, Callable] = {
    "sft": install_sft,
    "frozen_router": install_frozen_router,
    "densemixer": install_densemixer,
    "condenser": install_condenser,
}


def supported_methods() -> list[str]:
    """Names accepted by :func:`apply`."""
    return sorted(METHODS)


def apply(model: nn.Module, method: str = "sft", **options) -> MoEPatch:
    """Install moe-lab MoE blocks into a loaded HF MoE model in place and set up ``method``.

    Returns the :class:`MoEPatch` (``.layers`` handles, ``.export()``, ``.remove()``).
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
    patch = MoEPatch(model, method=method)
    installer(patch, **options)
    return patch
