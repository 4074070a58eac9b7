"""Per-expert computation on slices of the packed expert tensors (never ``experts.<i>`` submodules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .view import MoELayerView


def expert_forward(view: MoELayerView, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Output [n, H] of routed expert ``expert`` on tokens ``x`` [n, H] (unweighted: E_e(x); a family whose routing
    weight scales the expert input computes E_e(w x) = expert_forward(view, e, w * x))."""
    experts = view.experts
    if view.spec.expert_layout == "gpt_oss":
        gate_up = x @ experts.gate_up_proj[expert] + experts.gate_up_proj_bias[expert]
        return experts._apply_gate(gate_up) @ experts.down_proj[expert] + experts.down_proj_bias[expert]
    if view.spec.expert_layout == "transposed":
        gate, up = (x @ experts.gate_up_proj[expert]).chunk(2, dim=-1)
        return (up * experts.act_fn(gate)) @ experts.down_proj[expert]
    gate_up = F.linear(x, experts.gate_up_proj[expert])
    if view.spec.expert_act == "apply_gate":
        return F.linear(experts._apply_gate(gate_up), experts.down_proj[expert])
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(experts.act_fn(gate) * up, experts.down_proj[expert])


def expert_intermediate_size(view: MoELayerView) -> int:
    """Intermediate width I of one routed expert."""
    if view.spec.expert_layout in ("gpt_oss", "transposed"):
        return view.down_proj.shape[1]
    return view.down_proj.shape[2]


def dense_routing_weights(weights: torch.Tensor, indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N, E] routing weights: ``weights`` at ``indices``, 0 elsewhere."""
    return weights.new_zeros(weights.shape[0], num_experts).scatter(1, indices, weights)


def expert_mixture(view: MoELayerView, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The HF packed experts' mixture [N, H] of the (token, expert) pairs ``indices`` [N, k] with ``weights``: a weight
    scales the expert's output, or its input where the registry says ``weight_on_input`` (then, as HF, every expert
    runs on its weight-scaled copy of all tokens, a zero weight giving exactly 0, and the copies are summed)."""
    if not view.spec.weight_on_input:
        return view.experts(x, indices, weights)
    dense = dense_routing_weights(weights, indices, view.num_experts)
    routed_in = x.repeat(view.num_experts, 1) * dense.transpose(0, 1).reshape(-1, 1)
    return view.experts(routed_in).reshape(view.num_experts, -1, x.shape[-1]).sum(dim=0)
