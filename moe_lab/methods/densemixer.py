"""DenseMixer: conventional sparse forward, straight-through (dense) router gradient.

Forward value: the conventional top-k mixture, bit for bit. Backward: every expert e contributes
``dL/dw_e = <dL/dy, E_e(x)>`` to the router, where ``w`` are the *dense weights* of
:func:`dense_weights`. Selected experts get that through the ordinary sparse path; the inactive ones
through :class:`_InactiveExperts`, whose forward returns zeros and whose backward runs the inactive
experts without autograd, in token chunks sized to a memory budget. Expert parameters therefore get
exactly the conventional gradients; shared experts are untouched.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from ..moe.block import MoEBlock
from ..moe.experts import expert_forward, expert_intermediate_size
from ..moe.patch import MoEPatch
from ..moe.routing import RoutingRule, scores_from_logits


def dense_weights(rule: RoutingRule, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Weights [N, E] of every expert whose values at ``indices`` equal the conventional top-k weights.

    - softmax / sigmoid scores, no renormalisation: ``w_e = scaling * s_e``.
    - renormalised top-k (S = sum of the selected scores): ``w_e = scaling * s_e / S`` for the selected
      experts (gradient through S) and ``scaling * s_e / stopgrad(S)`` for the others.
    - softmax over the top-k logits (GPT-OSS): ``w_e = exp(l_e - m) / Z`` with m the largest selected
      logit and Z the sum over the selected; inactive experts use ``stopgrad(Z)`` (the same extension as
      the renormalised case: the top-k softmax, evaluated at an expert outside the top-k).
    """
    if rule.score == "sparsemixer":
        raise ValueError("densemixer is not defined for sparsemixer routing (phimoe)")
    selected = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, True)
    if rule.softmax_over_topk:
        top = logits.float().gather(1, indices)
        peak = top.max(dim=-1, keepdim=True).values.detach()
        numer = torch.exp(logits.float() - peak)
        denom = numer.gather(1, indices).sum(dim=-1, keepdim=True)
        weights = numer / torch.where(selected, denom, denom.detach())
    else:
        scores = scores_from_logits(rule, logits)
        weights = scores
        if rule.renormalize:
            denom = scores.gather(1, indices).sum(dim=-1, keepdim=True)
            if rule.renorm_eps:
                denom = denom + rule.renorm_eps
            weights = scores / torch.where(selected, denom, denom.detach())
    if rule.scaling != 1.0:
        weights = weights * rule.scaling
    return weights.to(logits.dtype) if rule.weights_in_logits_dtype else weights


class _InactiveExperts(torch.autograd.Function):
    """Zero-valued output whose backward gives each inactive weight ``<dL/dy, E_e(x)>``."""

    @staticmethod
    def forward(ctx, weights, x, inactive, view, chunk_tokens):
        ctx.save_for_backward(x, inactive)
        ctx.view, ctx.chunk_tokens = view, chunk_tokens
        return x.new_zeros(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x, inactive = ctx.saved_tensors
        grad_w = torch.zeros(inactive.shape, dtype=torch.float32, device=x.device)
        with torch.no_grad(), parametrize.cached():
            for e in range(inactive.shape[1]):
                tokens = inactive[:, e].nonzero().squeeze(-1)
                for chunk in tokens.split(ctx.chunk_tokens):
                    out = expert_forward(ctx.view, e, x[chunk])
                    grad_w[chunk, e] = (grad_out[chunk].float() * out.float()).sum(-1)
        return grad_w, None, None, None, None


class DenseMixerMixture:
    """``MoEBlock.mixer`` of DenseMixer: sparse value, straight-through router gradient."""

    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens

    def __call__(self, block: MoEBlock, x, logits, weights, indices):
        out = block.experts(x, indices, weights)
        if not torch.is_grad_enabled() or not logits.requires_grad:
            return out
        view = block.view.obj
        dense = dense_weights(view.rule, logits, indices)
        inactive = torch.ones_like(dense, dtype=torch.bool).scatter_(1, indices, False)
        straight = _InactiveExperts.apply(dense.masked_fill(~inactive, 0.0), x.detach(), inactive, view,
                                          self.chunk_tokens)
        return out + straight.to(out.dtype)


def install_densemixer(patch: MoEPatch, memory_budget_mb: float = 256.0) -> None:
    """Install DenseMixer on every MoE layer.

    ``memory_budget_mb`` bounds the activations of one inactive-expert chunk in the backward pass
    (tokens per chunk = budget / bytes of one token's expert activations).
    """
    if memory_budget_mb <= 0:
        raise ValueError(f"memory_budget_mb must be > 0, got {memory_budget_mb}")
    for view, block in zip(patch.views, patch.layers):
        if view.rule.score == "sparsemixer":
            raise ValueError(
                f"densemixer is not defined for {view.spec.model_type}: its sparsemixer routing already "
                "has its own router-gradient estimator; use method=sft"
            )
        width = 3 * expert_intermediate_size(view) + 2 * view.config.hidden_size
        per_token = width * view.down_proj.element_size()
        block.mixer = DenseMixerMixture(max(1, int(memory_budget_mb * 2**20 // per_token)))
