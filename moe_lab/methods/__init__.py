"""Fine-tuning methods: installers for ``moe_lab.apply`` and their LightningModules.

Each method module registers its installer, with the method's facts (and its export loader), in :mod:`.registry`.
Importing any part of ``moe_lab.methods`` imports every module of this package, so the registry is full and a new
method's module is found without being listed anywhere (docs/how-to-add.md)."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from .registry import METHODS, apply, supported_methods

__all__ = ["METHODS", "apply", "supported_methods"]
