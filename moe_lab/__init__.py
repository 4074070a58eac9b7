"""moe-lab: post-training Mixture-of-Experts language models with exact, testable methods.

The names below are imported on first use (PEP 562): ``import moe_lab`` itself only registers what the configs
need (the ``${moe_lab.shipped_data:...}`` resolver, the settings schemas), so ``run.py`` reports a mistyped override before torch,
Lightning and transformers load."""

from __future__ import annotations

from importlib import import_module

from .core.settings import register_schemas as _register_schemas
from .data import shipped as _shipped  # noqa: F401  (registers ${moe_lab.shipped_data:...})

_register_schemas()  # moe_lab_schema/optim, moe_lab_schema/scheduler: the typed task.optim / task.scheduler

#: public name -> the module that defines it
EXPORTS = {"MoEPatch": ".moe", "supported_families": ".moe", "apply": ".methods.registry",
           "supported_methods": ".methods.registry", "esft_scores": ".methods.esft", "esft_select": ".methods.esft"}
__all__ = ["MoEPatch", "apply", "supported_families", "supported_methods"]
__all__ += ["esft_scores", "esft_select"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in EXPORTS:
        value = getattr(import_module(EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
