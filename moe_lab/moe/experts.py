"""Per-expert computation on slices of the packed expert tensors (never ``experts.<i>`` submodules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize
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
                           offsets: torch.Tensor, split_lora: bool = False) -> torch.Tensor:
    """:func:`expert_forward` of many experts at once: row r of ``x`` [S, H] through expert ``expert_ids[r]``, the
    rows sorted by expert, ``offsets`` [E] int32 the cumulative row counts per expert. One grouped matmul per
    projection over the whole [E, ...] tensors (HF's ``grouped_mm`` dispatch), no per-expert loop or host sync.
    ``split_lora``: packed tensors carrying LoRA adapters run as ``x W + scale (x A) B`` per expert (the
    low-rank path on the rows themselves, :func:`_grouped_projection`), never materialising ``W + scale B A``."""
    experts, layout = view.experts, view.layout
    if not layout.packed:  # rows of 2-D tensors (DBRX), as [E, I, H] / [E, H, I] role views
        gate, up, down = view.roles()
        hidden = layout.activation(experts)(_grouped_linear(x, gate, offsets)) * _grouped_linear(x, up, offsets)
        return _grouped_linear(hidden, down, offsets)
    bias = experts.gate_up_proj_bias[expert_ids] if layout.biases else None
    gate_up = _grouped_projection(x, view, "gate_up_proj", offsets, bias, split_lora)
    bias = experts.down_proj_bias[expert_ids] if layout.biases else None
    return _grouped_projection(_packed_glu(view, gate_up), view, "down_proj", offsets, bias, split_lora)


def _grouped_projection(x: torch.Tensor, view: MoELayerView, name: str, offsets: torch.Tensor,
                        bias: torch.Tensor | None, split_lora: bool) -> torch.Tensor:
    """One packed projection ``name`` of the sorted rows ``x``. With ``split_lora`` and a LoRA parametrization on
    the tensor (W [E, m, n] stored, B [E, m, r], A [E, r, n]): ``x W^T + scale (x A^T) B^T``, or for a transposed
    layout (x W, W [E, H_in, H_out]) ``x W + scale (x B) A``: the same function as ``W + scale B A`` in rank-r
    steps (Unsloth's "split LoRA"), with no [E, m, n] delta or its gradient."""
    experts, transposed = view.experts, view.layout.transposed
    lora = None
    if split_lora and parametrize.is_parametrized(experts, name):
        weight, lora = experts.parametrizations[name].original, experts.parametrizations[name][0]
    else:
        weight = getattr(experts, name)
    out = _grouped_linear(x, weight, offsets, bias=bias, is_transposed=transposed)  # in the weight's dtype, as HF
    if lora is None:
        return out
    first, second = (lora.lora_B, lora.lora_A) if transposed else (lora.lora_A, lora.lora_B)
    x, first, second = x.to(weight.dtype), first.to(weight.dtype), second.to(weight.dtype)
    return out + lora.scale * _rank_step(_rank_step(x, first, offsets, transposed), second, offsets, transposed)


def _rank_step(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    """One grouped matmul of a LoRA factor; torch's grouped GEMM needs every row stride a multiple of 16 bytes,
    which a small rank may not give (rank 2 in fp32, rank 4 in bf16): those run transformers' per-expert
    fallback (one host sync)."""
    if all(size * x.element_size() % 16 == 0 for size in (x.shape[-1], *weight.shape[-2:])):
        return _grouped_linear(x, weight, offsets, is_transposed=transposed)
    return torch.ops.transformers.grouped_mm_fallback(x, weight if transposed else weight.transpose(-2, -1),
                                                      offs=offsets)


def split_lora_mixture(view: MoELayerView, x: torch.Tensor, weights: torch.Tensor,
                       indices: torch.Tensor) -> torch.Tensor:
    """The conventional top-k mixture [N, H] of packed experts carrying LoRA adapters, computed split
    (:func:`_grouped_projection`): HF's ``grouped_mm`` experts forward step for step (pairs sorted by expert,
    weighted on the output, restored to token order and summed over the k slots), with each projection's
    low-rank term added. So with B = 0 (LoRA's init) it is vanilla's grouped_mm mixture bit for bit, and otherwise
    the mixture on the merged weights ``W + scale B A`` up to float rounding (tests/methods/test_split_lora.py)."""
    n, k = indices.shape
    flat = indices.reshape(-1)
    experts, order = torch.sort(flat)
    counts = torch.zeros(view.num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # a bincount without a host sync
    out = grouped_expert_forward(view, x[order // k], experts, counts.cumsum(0, dtype=torch.int32), split_lora=True)
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    return out[restore].view(n, k, -1).sum(dim=1).to(x.dtype)


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
