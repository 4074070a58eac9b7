"""The uniform view of one MoE layer: router, packed experts, shared experts, routing rule.

Built from the family registry; methods, statistics and weight surgery read only this view.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from .layout import LAYOUTS, ExpertLayout
from .registry import FamilySpec, family_spec
from .routing import RoutingRule

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")  # DBRX: transformer.blocks.<i>


def router_weight_of(router: nn.Module, attr: str) -> torch.Tensor:
    """The tensor at the dotted ``attr`` under ``router`` (``weight``, ``wg.weight``). Plain attribute access, not
    ``get_parameter``: under FSDP with ``use_orig_params`` the forward sees views that are not ``nn.Parameter``."""
    for name in attr.split("."):
        router = getattr(router, name)
    return router


@dataclass
class MoELayerView:
    """One MoE layer seen uniformly. ``block`` is the HF block (the moe-lab block shares its children)."""

    index: int  # decoder layer index
    name: str  # module path of the block in the model
    spec: FamilySpec
    rule: RoutingRule
    block: nn.Module
    config: object = None  # the HF model config
    installed: nn.Module | None = None  # the moe-lab block in the model while installed (it owns block's tensors)

    @property
    def module(self) -> nn.Module:
        """The block currently in the model: the moe-lab block while installed, else the HF block."""
        return self.installed if self.installed is not None else self.block

    @property
    def router(self) -> nn.Module:
        return getattr(self.block, self.spec.router_attr)

    @property
    def experts(self) -> nn.Module:
        return self.block.experts

    @property
    def shared(self) -> nn.Module | None:
        return getattr(self.block, self.spec.shared_attr, None) if self.spec.shared_attr else None

    @property
    def shared_gate(self) -> nn.Module | None:
        return getattr(self.block, self.spec.shared_gate_attr) if self.spec.shared_gate_attr else None

    @property
    def router_weight(self) -> torch.Tensor:
        """The router's [E, H] weight (registry ``router_weight_attr``: the router's own, or a wrapped Linear's)."""
        return router_weight_of(self.router, self.spec.router_weight_attr)

    @property
    def router_bias(self) -> torch.Tensor | None:
        """The router's additive logit bias (GPT-OSS); None for bias-free routers."""
        bias = getattr(self.router, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    @property
    def correction_bias(self) -> torch.Tensor | None:
        """The selection-only bias [E] (DeepSeek-V3's router ``e_score_correction_bias``, or the block's own buffer
        named by the registry's ``correction_bias_attr``); None for routers without one."""
        if self.spec.correction_bias_attr is None:
            return getattr(self.router, "e_score_correction_bias", None)
        owner, _, name = self.spec.correction_bias_attr.rpartition(".")
        bias = getattr(self.module.get_submodule(owner), name, None)
        return None if bias is None else bias.view(-1)  # ERNIE keeps it as [1, E]

    @property
    def layout(self) -> ExpertLayout:
        """How the routed experts' tensors are stored (registry ``expert_layout``)."""
        return LAYOUTS[self.spec.expert_layout]

    @property
    def expert_module(self) -> nn.Module:
        """The module owning the routed expert tensors (the experts module, or DBRX's ``experts.mlp``)."""
        return self.layout.module(self.experts)

    @property
    def gate_up_proj(self) -> torch.Tensor:
        """The packed [E, 2I, H] (GPT-OSS: [E, H, 2I]) tensor; layouts without one raise, naming the layout."""
        if not self.layout.packed:
            raise AttributeError(f"{self.spec.model_type}'s experts ({self.layout.name} layout) have no packed "
                                 "gate_up_proj: read MoELayerView.roles() or expert_parameters()")
        return self.experts.gate_up_proj

    @property
    def down_proj(self) -> torch.Tensor:
        """The routed experts' down projections: the packed tensor, or an [E, H, I] view of the layout's."""
        return self.experts.down_proj if self.layout.packed else self.roles()[2]

    @property
    def expert_dtype(self) -> torch.dtype:
        return next(iter(self.expert_parameters().values())).dtype

    def roles(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [E, I, H], up [E, I, H], down [E, H, I])``: views of the routed experts' SwiGLU factors."""
        return self.layout.roles(self.experts, self.num_experts)

    @property
    def num_experts(self) -> int:
        return self.rule.num_experts

    @property
    def top_k(self) -> int:
        return self.rule.top_k

    def expert_parameters(self) -> dict[str, torch.Tensor]:
        """The routed expert tensors as [E, ...] views of the parameters (leading dim = expert), by attribute name
        in :attr:`expert_module`."""
        return self.layout.tensors(self.experts, self.num_experts)


def layer_index(module_name: str) -> int:
    """Decoder layer index parsed from a module path such as ``model.layers.3.mlp`` (``transformer.blocks.3.ffn``)."""
    match = _LAYER_INDEX.search(module_name + ".")
    if match is None:
        raise ValueError(f"cannot find a decoder layer index in module path {module_name!r}")
    return int(match.group(1))


def find_moe_layers(model: nn.Module, *, block_class: str | None = None) -> list[MoELayerView]:
    """Every MoE block of an HF model, as uniform views, in layer order.

    ``block_class`` overrides the registry's class name (used when blocks are already replaced).
    """
    config = model.config
    spec = family_spec(config.model_type)
    rule = spec.routing_rule(config)
    wanted = block_class or spec.block_class
    views = []
    for name, module in model.named_modules():
        if type(module).__name__ == wanted:
            views.append(MoELayerView(layer_index(name), name, spec, rule, module, config))
    if not views:
        raise ValueError(
            f"no {spec.block_class} found in the {config.model_type} model: is every layer dense "
            "(mlp_only_layers / first_k_dense_replace / num_experts=0)?"
        )
    return sorted(views, key=lambda v: v.index)


def dense_layer_indices(model: nn.Module, views: list[MoELayerView]) -> list[int]:
    """Decoder layers that hold a dense MLP instead of an MoE block."""
    moe = {v.index for v in views}
    return [i for i in range(model.config.num_hidden_layers) if i not in moe]
