"""The uniform view of every supported HF MoE family and moe-lab's MoE block."""

from .aux_loss import switch_balance_loss as switch_aux_loss  # the public name of HF's Switch loss
from .block import MoEBlock
from .patch import MoEPatch
from .registry import FAMILIES, FamilySpec, family_spec, supported_families
from .routing import RoutingRule
from .view import MoELayerView, find_moe_layers

__all__ = [
    "FAMILIES", "FamilySpec", "MoEBlock", "MoELayerView", "MoEPatch", "RoutingRule",
    "family_spec", "find_moe_layers", "supported_families", "switch_aux_loss",
]
