"""Per-expert computation on slices of the packed expert tensors (never ``experts.<i>`` submodules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .view import MoELayerView


def expert_forward(view: MoELayerView, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Output [n, H] of routed expert ``expert`` on tokens ``x`` [n, H] (unweighted)."""
    experts = view.experts
    if view.spec.expert_layout == "gpt_oss":
        gate_up = x @ experts.gate_up_proj[expert] + experts.gate_up_proj_bias[expert]
        return experts._apply_gate(gate_up) @ experts.down_proj[expert] + experts.down_proj_bias[expert]
    if not view.layout.packed:  # rows of 2-D tensors (DBRX), applied as its DbrxExpertGLU does: x @ W.T
        gate, up, down = (t[expert] for t in view.roles())
        return (view.layout.activation(experts)(x.matmul(gate.T)) * x.matmul(up.T)).matmul(down.T)
    gate_up = F.linear(x, experts.gate_up_proj[expert])
    if view.spec.expert_act == "apply_gate":
        return F.linear(experts._apply_gate(gate_up), experts.down_proj[expert])
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(experts.act_fn(gate) * up, experts.down_proj[expert])


def expert_intermediate_size(view: MoELayerView) -> int:
    """Intermediate width I of one routed expert."""
    return view.roles()[0].shape[1]
