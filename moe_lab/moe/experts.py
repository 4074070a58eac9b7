"""Per-expert computation on slices of the packed expert tensors (never ``experts.<i>`` submodules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.moe import _grouped_linear

from .view import MoELayerView


def expert_forward(view: MoELayerView, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Output [n, H] of routed expert ``expert`` on tokens ``x`` [n, H] (unweighted: E_e(x); a family whose routing
    weight scales the expert input computes E_e(w x) = expert_forward(view, e, w * x))."""
    experts, layout = view.experts, view.layout
    if not layout.packed:  # rows of 2-D tensors (DBRX)
        gate, up, down = (t[expert] for t in view.roles())
        return _row_block_hidden(layout.activation(experts), gate, up, x, x).matmul(down.T)
    gate_up = layout.project(x, experts.gate_up_proj[expert])
    if layout.biases:
        gate_up = gate_up + experts.gate_up_proj_bias[expert]
    out = layout.project(_packed_glu(view, gate_up), experts.down_proj[expert])
    return out + experts.down_proj_bias[expert] if layout.biases else out


def grouped_expert_forward(view: MoELayerView, x: torch.Tensor, expert_ids: torch.Tensor,
                           offsets: torch.Tensor) -> torch.Tensor:
    """:func:`expert_forward` of many experts at once: row r of ``x`` [S, H] through expert ``expert_ids[r]``, the
    rows sorted by expert, ``offsets`` [E] int32 the cumulative row counts per expert. One grouped matmul per
    projection over the whole [E, ...] tensors (HF's ``grouped_mm`` dispatch), no per-expert loop or host sync."""
    experts, layout = view.experts, view.layout
    if not layout.packed:  # rows of 2-D tensors (DBRX), as [E, I, H] / [E, H, I] role views
        gate, up, down = view.roles()
        hidden = layout.activation(experts)(_grouped_linear(x, gate, offsets)) * _grouped_linear(x, up, offsets)
        return _grouped_linear(hidden, down, offsets)
    bias = experts.gate_up_proj_bias[expert_ids] if layout.biases else None
    gate_up = _grouped_linear(x, experts.gate_up_proj, offsets, bias=bias, is_transposed=layout.transposed)
    bias = experts.down_proj_bias[expert_ids] if layout.biases else None
    return _grouped_linear(_packed_glu(view, gate_up), experts.down_proj, offsets, bias=bias,
                           is_transposed=layout.transposed)


def _packed_glu(view: MoELayerView, gate_up: torch.Tensor) -> torch.Tensor:
    """A packed expert's intermediate activation [n, I] from its gate_up projection [n, 2I]: the experts' own
    ``_apply_gate`` where the registry says so (clamped GLUs), else act(gate) * up in the layout's split."""
    if view.spec.expert_act == "apply_gate":
        return view.experts._apply_gate(gate_up)
    gate, up = view.layout.split(gate_up)
    return view.layout.activation(view.experts)(gate) * up


def _row_block_hidden(act, gate: torch.Tensor, up: torch.Tensor, gate_in: torch.Tensor,
                      up_in: torch.Tensor) -> torch.Tensor:
    """One row-blocked expert's intermediate activation [n, I], as DBRX's ``DbrxExpertGLU`` computes it:
    ``act(gate_in @ gate.T) * (up_in @ up.T)`` (its down projection is then ``@ down.T``)."""
    return act(gate_in.matmul(gate.T)) * up_in.matmul(up.T)


def expert_intermediate_size(view: MoELayerView) -> int:
    """Intermediate width I of one routed expert."""
    return view.roles()[0].shape[1]


def dense_routing_weights(weights: torch.Tensor, indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N, E] routing weights: ``weights`` at ``indices``, 0 elsewhere."""
    return weights.new_zeros(weights.shape[0], num_experts).scatter(1, indices, weights)


def expert_mixture(view: MoELayerView, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The HF experts module's mixture [N, H] of the (token, expert) pairs ``indices`` [N, k] with ``weights``: a
    weight scales the expert's output, or its input where the registry says ``weight_on_input`` (then, as HF, every
    expert runs on its weight-scaled copy of all tokens, a zero weight giving exactly 0, and the copies are summed).
    The output is viewed as [N, H] (DBRX's experts module returns [N, 1, H])."""
    if not view.spec.weight_on_input:
        return view.experts(x, indices, weights).view(x.shape)
    dense = dense_routing_weights(weights, indices, view.num_experts)
    routed_in = x.repeat(view.num_experts, 1) * dense.transpose(0, 1).reshape(-1, 1)
    return view.experts(routed_in).reshape(view.num_experts, -1, x.shape[-1]).sum(dim=0)


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
        hidden = _row_block_hidden(act, gate, up, gate_in, up_in)
        if "act_scale" in scales:
            hidden = hidden * scales["act_scale"][tokens]
        y = hidden.matmul(down.T) * weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
