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


def looped_mixture(view: MoELayerView, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                   scales: dict[str, torch.Tensor] | None = None, frozen: torch.Tensor | None = None) -> torch.Tensor:
    """The routed mixture [N, H] as HF's per-expert loop computes it for experts stored as row blocks (DBRX's
    ``DbrxExperts.forward``: experts in id order, each on its (slot, token) pairs from ``torch.where``, weighted and
    added into zeros), on the layout's role views, so bit for bit the same. ``scales`` (Compressed Experts): per-token
    ``input_scale`` [N, H] on the gate input, optional ``up_input_scale`` [N, H] on the up input (else the gate's)
    and ``act_scale`` [N, I] on the intermediate activation. ``frozen`` [E] bool: those experts run on DETACHED
    weights (ESFT: no weight gradient is computed for them; the input gradient is)."""
    scales = scales or {}
    gate_w, up_w, down_w = view.roles()
    act = view.layout.activation(view.experts)
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(indices, num_classes=view.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()
    for e in hit:
        with torch.no_grad():
            slots, tokens = torch.where(mask[e])
        gate, up, down = gate_w[e], up_w[e], down_w[e]
        if frozen is not None and bool(frozen[e]):
            gate, up, down = gate.detach(), up.detach(), down.detach()
        rows = x[tokens]
        gate_in = rows * scales["input_scale"][tokens] if "input_scale" in scales else rows
        up_in = rows * scales["up_input_scale"][tokens] if "up_input_scale" in scales else gate_in
        hidden = act(gate_in.matmul(gate.T)) * up_in.matmul(up.T)
        if "act_scale" in scales:
            hidden = hidden * scales["act_scale"][tokens]
        y = hidden.matmul(down.T) * weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
