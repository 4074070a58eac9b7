"""Lightning callbacks for observing MoE training: expert load and gradient norms."""

from .expert_load import ExpertLoadCallback
from .grad_norm import GradNormCallback

__all__ = ["ExpertLoadCallback", "GradNormCallback"]
