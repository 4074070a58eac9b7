"""Fine-tuning methods: installers for ``moe_lab.apply`` and their LightningModules.

Each method module registers its installer (and its export loader) with :mod:`.registry`; importing them here
fills the registry whenever any part of ``moe_lab.methods`` is imported."""

# each registers itself with .registry on import
from . import compressed_experts, condenser, densemixer, esft, lora, peft_export, sft  # noqa: F401
from .registry import METHODS, apply, supported_methods

__all__ = ["METHODS", "apply", "supported_methods"]
