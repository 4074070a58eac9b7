"""Conventional SFT and frozen-router SFT: HF routing, gradients only through selected experts."""

from __future__ import annotations

from ..moe.patch import MoEPatch
from .registry import register_method


@register_method("sft", expert_parallel=True)
def install_sft(patch: MoEPatch) -> None:
    """Conventional SFT needs nothing beyond the moe-lab blocks."""


@register_method("frozen_router", expert_parallel=True)
def install_frozen_router(patch: MoEPatch, freeze_router_bias: bool = True) -> None:
    """Freeze every router weight (and the GPT-OSS logit bias unless ``freeze_router_bias=False``)."""
    for view in patch.views:
        view.router_weight.requires_grad_(False)
        bias = view.router_bias
        if bias is not None and freeze_router_bias:
            bias.requires_grad_(False)
