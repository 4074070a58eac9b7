"""Lightning callbacks for observing MoE training: expert load, gradient norms, router biases, routing drift."""

from .expert_load import ExpertLoadCallback
from .grad_norm import GradNormCallback
from .router_bias import RouterBiasCallback
from .routing_drift import RoutingDriftCallback

__all__ = ["ExpertLoadCallback", "GradNormCallback", "RouterBiasCallback", "RoutingDriftCallback"]
