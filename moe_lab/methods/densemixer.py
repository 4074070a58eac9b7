"""DenseMixer (Yao et al. 2025, "DenseMixer: Improving MoE Post-Training with Precise Router Gradient").

Three named estimators (``install_densemixer(gradient=..., forward=...)``); ``w`` are the *dense weights*
of :func:`dense_weights` (equal to the conventional top-k weights on the selected experts), ``M_j`` =
1[j in TopK], ``g = dL/dy``, ``E_j(x)`` expert j's unweighted output:

- ``gradient="straight_through"`` (default; the public code and the blog): forward value = the
  conventional top-k mixture, bit for bit; router gradient ``dL/dw_j = <g, E_j(x)>`` for EVERY expert j
  (TopK treated as the identity in the backward pass).
- ``gradient="paper_eq15"``: the paper's Eq. 15, which writes a ``(pi_j + TopK_j)`` factor. Our reading:
  Eq. 15 differentiates ``y = sum_j pi_j M_j E_j(x)`` by the product rule with the straight-through
  ``dM_j/dpi_j := 1``, so ``dL/dw_j = (w_j + M_j) <g, E_j(x)>`` (pi_j = w_j, the factor a constant):
  selected experts get ``(1 + w_j)`` times their conventional router gradient, inactive ones
  ``w_j <g, E_j(x)>``. Forward value again the conventional one, bit for bit.
- ``forward="dense", gradient="conventional"``: the paper's ablation "dense forward + conventional
  gradient". Our reading: while training, the layer's VALUE is the dense mixture ``sum_j w_j E_j(x)`` over
  all experts, and its gradient is the conventional sparse one (the inactive experts' term is a constant:
  ``y = y_topk + stopgrad(sum_{j not in TopK} w_j E_j(x))``). Evaluation (``block.eval()``) and exports
  route conventionally. With renormalised weights the inactive ``w_j`` use the top-k sum as normaliser
  (see :func:`dense_weights`), so the dense weights then sum to more than 1, as in the STE's extension.

In every variant expert parameters get exactly the conventional gradients and shared experts are untouched.
Inactive experts run without autograd (in the backward pass for the straight-through variants, in the
forward pass for the ablation), in token chunks sized to a memory budget: per chunk every (token, inactive
expert) pair, sorted by expert, goes through one grouped matmul per projection (no per-expert loop, no host sync),
so they cost the FLOP floor N (E - k) expert forwards per layer. Under autocast they run in the autocast dtype, as
the block runs the selected experts (:func:`~moe_lab.moe.block.autocast_expert_weights`), in the backward too.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.utils import parametrize, stateless

from ..analysis.estimate import CostContext, register_cost_row
from ..moe.block import MoEBlock, autocast_expert_weights, sparse_mixture, splits_lora
from ..moe.experts import expert_intermediate_size, grouped_expert_forward
from ..moe.patch import MoEPatch
from ..moe.routing import RoutingRule, scores_from_logits, topk_denominator
from ..moe.support import first_reason, output_weighted, sparsemixer_only
from ..runtime.expert_parallel import dispatch_of, pair_dots, pair_mixture
from .registry import method_spec, register_method


def dense_weights(rule: RoutingRule, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Weights [N, E] of every expert whose values at ``indices`` equal the conventional top-k weights.

    - softmax / sigmoid scores, no renormalisation: ``w_e = scaling * s_e``.
    - renormalised top-k (S = sum, or p-norm, of the selected scores): ``w_e = scaling * s_e / S`` for the selected
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
            denom = topk_denominator(rule, scores.gather(1, indices))
            weights = scores / torch.where(selected, denom, denom.detach())
    if rule.scaling != 1.0:
        weights = weights * rule.scaling
    return weights.to(logits.dtype) if rule.weights_in_logits_dtype else weights


GRADIENTS = ("straight_through", "paper_eq15", "conventional")
FORWARDS = ("sparse", "dense")
# the named variants: (forward, gradient)
VARIANTS = {("sparse", "straight_through"), ("sparse", "paper_eq15"), ("dense", "conventional")}


def inactive_experts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N, E - k] ids of the experts outside each token's top-k ``indices`` [N, k] (distinct ids), ascending: a sort
    of the selection mask, so no host sync."""
    selected = torch.zeros(indices.shape[0], num_experts, dtype=torch.uint8, device=indices.device)
    selected.scatter_(1, indices, 1)
    return torch.sort(selected, dim=1, stable=True).indices[:, :num_experts - indices.shape[1]]


def _inactive_expert_outputs(view, x: torch.Tensor, indices: torch.Tensor, chunk_tokens: int, visit,
                             split_lora: bool = False) -> None:
    """Every (token, expert outside the token's top-k ``indices``) pair's output without autograd, in chunks of at
    most ``chunk_tokens`` tokens: per chunk the pairs are sorted by expert and run as one grouped matmul per
    projection. ``visit(rows, tokens, experts, order, outputs)`` consumes each chunk of tokens ``rows`` (a slice):
    the pairs' tokens (chunk-relative) and experts [S], each pair's position ``order`` [S] in the chunk's
    token-major [T, E - k] pair table (:func:`inactive_experts`) and the outputs [S, H], all in expert order.
    ``split_lora``: adapted packed experts run split (x A B, no merged weights; moe/experts.py)."""
    others = view.num_experts - indices.shape[1]
    if others == 0:
        return
    with torch.no_grad(), parametrize.cached():
        for start in range(0, x.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            flat = inactive_experts(indices[rows], view.num_experts).reshape(-1)
            experts, order = torch.sort(flat, stable=True)
            counts = torch.zeros(view.num_experts, dtype=torch.int32, device=flat.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount without a host sync
            tokens = order // others
            out = grouped_expert_forward(view, x[rows][tokens], experts, counts.cumsum(0, dtype=torch.int32),
                                         split_lora)
            visit(rows, tokens, experts, order, out)


class _InactiveExperts(torch.autograd.Function):
    """Zero-valued output whose backward gives each inactive weight ``<dL/dy, E_e(x)>``."""

    @staticmethod
    def forward(ctx, weights, x, indices, view, chunk_tokens, split_lora):
        ctx.save_for_backward(x, indices)
        ctx.view, ctx.chunk_tokens, ctx.split_lora = view, chunk_tokens, split_lora
        device = x.device.type
        ctx.autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return x.new_zeros(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x, indices = ctx.saved_tensors
        grad_w = torch.zeros(x.shape[0], ctx.view.num_experts, dtype=torch.float32, device=x.device)

        def visit(rows, tokens, experts, order, out):
            grad_w[rows].index_put_((tokens, experts), (grad_out[rows][tokens].float() * out.float()).sum(-1))

        # the experts in the precision the forward ran them in: under autocast, the block's casts of the expert
        # tensors (autocast is off in the backward pass, and HF's grouped matmuls would run the fp32 masters)
        device, experts = x.device.type, ctx.view.experts
        with torch.autocast(device, dtype=ctx.autocast, enabled=ctx.autocast is not None):
            cast = autocast_expert_weights(experts, device)
            with stateless._reparametrize_module(experts, cast) if cast else contextlib.nullcontext():
                if dispatch_of(experts) is not None:  # expert parallel: each pair on its expert's owner
                    inactive = inactive_experts(indices, ctx.view.num_experts)
                    grad_w.scatter_(1, inactive, pair_dots(experts, x, inactive, grad_out, ctx.chunk_tokens))
                else:
                    _inactive_expert_outputs(ctx.view, x, indices, ctx.chunk_tokens, visit, ctx.split_lora)
        return grad_w, None, None, None, None, None


class DenseMixerMixture:
    """``MoEBlock.mixer`` of DenseMixer (the variants of the module docstring)."""

    def __init__(self, chunk_tokens: int, gradient: str = "straight_through", forward: str = "sparse"):
        self.chunk_tokens = chunk_tokens
        self.gradient = gradient
        self.forward = forward

    def __call__(self, block: MoEBlock, x, logits, weights, indices):
        view = block.view.obj
        if self.forward == "dense":
            return self._dense_forward(block, view, x, logits, weights, indices)
        if not torch.is_grad_enabled() or not logits.requires_grad:
            return sparse_mixture(block, x, logits, weights, indices)
        if self.gradient == "paper_eq15":
            # same value bit for bit (w - stopgrad(w) == 0 exactly); dL/dw scaled by (1 + w) on the top-k
            weights = weights + weights.detach() * (weights - weights.detach())
        out = sparse_mixture(block, x, logits, weights, indices)
        dense = dense_weights(view.rule, logits, indices)
        straight = dense.scatter(1, indices, 0.0)
        if self.gradient == "paper_eq15":
            straight = straight * dense.detach()  # dL/dw_j = w_j <g, E_j(x)> off the top-k
        split = block.split_lora and splits_lora(view)
        straight = _InactiveExperts.apply(straight, x.detach(), indices, view, self.chunk_tokens, split)
        return out + straight.to(out.dtype)

    def _dense_forward(self, block, view, x, logits, weights, indices):
        out = sparse_mixture(block, x, logits, weights, indices)
        if not block.training:
            return out
        with torch.no_grad():
            dense = dense_weights(view.rule, logits, indices)
            if dispatch_of(view.experts) is not None:  # expert parallel: each pair on its expert's owner
                inactive = inactive_experts(indices, view.num_experts)
                extra = pair_mixture(view.experts, x.detach(), inactive, dense.gather(1, inactive),
                                     self.chunk_tokens).to(out.dtype)
            else:
                extra = torch.zeros_like(out)

                def visit(rows, tokens, experts, order, expert_out):  # summed per token in expert order (deterministic)
                    weighted = dense[rows][tokens, experts, None] * expert_out
                    pairs = weighted.new_empty(weighted.shape).index_copy_(0, order, weighted)
                    extra[rows] = pairs.view(-1, view.num_experts - indices.shape[1],
                                             pairs.shape[-1]).sum(1).to(extra.dtype)

                _inactive_expert_outputs(view, x.detach(), indices, self.chunk_tokens, visit,
                                         block.split_lora and splits_lora(view))
        return out + extra


#: where DenseMixer is undefined (its registration's ``undefined_for``)
UNDEFINED_FOR = first_reason(
    sparsemixer_only("sparsemixer routing already has its own router-gradient estimator (Heun's third-order); use "
                     "method=sft"),
    output_weighted("DenseMixer's straight-through router gradient dL/dw_e = <dL/dy, E_e(x)> is the derivative "
                    "of the output-weighted mixture sum_e w_e E_e(x) (TopK as the identity), and the paper defines "
                    "no estimator for dy/dw_e = J_e(w_e x) x"))


@register_method("densemixer", undefined_for=UNDEFINED_FOR, expert_parallel=True, cost_row="densemixer")
def install_densemixer(patch: MoEPatch, memory_budget_mb: float = 256.0, gradient: str = "straight_through",
                       forward: str = "sparse") -> None:
    """Install DenseMixer on every MoE layer.

    ``gradient``/``forward``: the variant (module docstring): ``straight_through`` (default) or
    ``paper_eq15`` with ``forward="sparse"``; ``forward="dense", gradient="conventional"`` is the paper's
    ablation. ``memory_budget_mb`` bounds the activations of one inactive-expert chunk (tokens per chunk =
    budget / bytes of one token's E - k inactive (token, expert) pairs: input, gate_up, intermediate, output and
    upstream gradient rows, 3 I + 3 H elements each).
    """
    if memory_budget_mb <= 0:
        raise ValueError(f"method.options.memory_budget_mb must be > 0, got {memory_budget_mb}")
    if gradient not in GRADIENTS:
        raise ValueError(f"method.options.gradient={gradient!r} is not one of {GRADIENTS}")
    if forward not in FORWARDS:
        raise ValueError(f"method.options.forward={forward!r} is not one of {FORWARDS}")
    if (forward, gradient) not in VARIANTS:
        fix = ("sparse forward + conventional gradient is method=sft" if gradient == "conventional" else
               "the dense forward is the paper's ablation with gradient=conventional")
        raise ValueError(f"method.options.forward={forward!r} with gradient={gradient!r} is not a DenseMixer "
                         f"variant ({fix}); variants (forward, gradient): {sorted(VARIANTS)}")
    for view, block in zip(patch.views, patch.layers):
        method_spec("densemixer").refuse_undefined(view.spec, view.rule)
        width = 3 * expert_intermediate_size(view) + 3 * view.config.hidden_size
        per_token = max(1, view.num_experts - view.top_k) * width * view.down_proj.element_size()
        block.mixer = DenseMixerMixture(max(1, int(memory_budget_mb * 2**20 // per_token)), gradient, forward)


@register_cost_row("densemixer", order=10)
def densemixer_costs(ctx: CostContext) -> dict:
    """The estimate's row: SFT's forward; SFT's backward plus the inactive experts' pass and the router's
    straight-through products."""
    ste = sum(2 * s.num_experts * ctx.h for s in ctx.counts.experts)  # <dL/dy, E_e(x)> for every expert
    inactive = ctx.experts(lambda s: s.num_experts - s.top_k)
    out = ctx.row(
        ctx.sft_f, ctx.sft_b + inactive + ste, ctx.counts.total, ctx.assign_k, inactive_pass=True,
        note="forward = SFT; backward = SFT + the inactive experts run without autograd (chunked, nothing "
        "stored) + the router's straight-through products (the paper counts the inactive experts in its "
        "forward)")
    out["flops_per_token_inactive_experts"] = inactive
    return out
