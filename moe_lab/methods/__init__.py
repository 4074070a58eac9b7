"""Fine-tuning methods: installers for ``moe_lab.apply`` and their LightningModules."""

from .registry import METHODS, apply, supported_methods

__all__ = ["METHODS", "apply", "supported_methods"]
