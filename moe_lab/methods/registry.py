"""The method registry: ``moe_lab.apply(model, method, **options)``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

from torch import nn

from ..moe.block import MoEBlock
from ..moe.patch import MoEPatch

#: method name -> installer ``(patch, **options)``; each method module registers its own
#: (:func:`register_method`) and ``moe_lab.methods`` imports them all, so the registry imports none of them
METHODS: dict[str, Callable] = {}
#: adapter name -> ``(patch, base_parameters, **options)`` added on top of any method (``apply(lora={...})``)
ADAPTERS: dict[str, Callable] = {}


def _register(table: dict, key: str, what: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        if key in table and table[key] is not fn:
            raise ValueError(f"{what} {key!r} is registered twice: {table[key].__module__} and "
                             f"{fn.__module__}")
        table[key] = fn
        return fn

    return register


def register_method(name: str) -> Callable[[Callable], Callable]:
    """``@register_method("sft")`` on an installer: ``apply(model, "sft", **options)`` calls it."""
    return _register(METHODS, name, "method")


def register_adapter(name: str) -> Callable[[Callable], Callable]:
    """``@register_adapter("lora")`` on an adapter: ``apply(model, method, lora={...})`` adds it."""
    return _register(ADAPTERS, name, "adapter")


def register_export_loader(filename: str) -> Callable[[Callable], Callable]:
    """``@register_export_loader(STATE_FILE)`` on a loader ``(model, directory) -> MoEPatch``: an export
    holding ``filename`` gets its method re-installed by :func:`install_exported_routing`."""
    return _register(EXPORT_LOADERS, filename, "export loader")


# files a method writes beside an export -> the loader that re-installs that method on the vanilla model
EXPORT_LOADERS: dict[str, Callable] = {}  # filled by register_export_loader


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
        add_lora = ADAPTERS["lora"]
        accepted = set(inspect.signature(add_lora).parameters) - {"patch", "base_parameters"}
        bad = sorted(set(lora) - accepted)
        if bad:
            raise TypeError(f"lora got unknown option(s) {bad}; it accepts {sorted(accepted)}")
        add_lora(patch, base_parameters, **lora)
    return patch
