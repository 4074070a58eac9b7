"""moe-lab: post-training Mixture-of-Experts language models with exact, testable methods."""

from .data import shipped as _shipped  # noqa: F401  (registers ${moe_lab.shipped_data:...})
from .methods.esft import esft_scores, esft_select
from .methods.registry import apply, supported_methods
from .moe import MoEPatch, supported_families

__all__ = ["MoEPatch", "apply", "supported_families", "supported_methods"]
__all__ += ["esft_scores", "esft_select"]
__version__ = "0.1.0"
