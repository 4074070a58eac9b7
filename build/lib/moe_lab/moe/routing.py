"""Routing rules: the one description of how every supported family turns router logits into
top-k expert indices and weights.

A :class:`RoutingRule` is built per layer by the family registry from the HF config; :func:`route`
executes it. Methods that change routing (selection biases, forced experts) hook in through the
``selection_bias`` argument and never branch on the family.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCORE_FUNCTIONS = ("softmax", "sigmoid", "identity", "sparsemixer")
# where select_topk adds a selection bias (see select_topk)
BIAS_SPACES = ("logits", "scores")


@dataclass(frozen=True)
class RoutingRule:
    """How one MoE layer routes a token.

    score: softmax | sigmoid | identity (top-k taken on raw logits) | sparsemixer (PhiMoE).
    logits_fp32: router matmul in fp32 (DeepSeek). renormalize: divide the top-k weights by their sum
    (+ renorm_eps). softmax_over_topk: softmax over the selected logits (GPT-OSS). scaling: routed
    scaling factor. n_group/topk_group/group_score/group_fill: group-limited selection;
    group_masks_weights: experts outside the kept groups weigh 0 (DeepSeek-V2 reads its weights from
    the masked probabilities; DeepSeek-V3 from the unmasked scores).
    uses_correction_bias: add the router's ``e_score_correction_bias`` for selection only.
    weights_in_logits_dtype: cast the weights back to the logits dtype (else they stay fp32).
    logits_upcast: router matmul in the input dtype, then the logits cast to fp32 (Granite-MoE).
    weights_in_input_dtype: the block casts the weights to its input dtype (Granite-MoE, ERNIE, Jamba).
    renorm_min: the top-k sum is clamped below at this value before dividing (ERNIE 4.5's moe_norm_min).
    scores_fp32: sigmoid scores of the fp32-cast logits, the logits themselves left in their dtype (MiniMax-M2).
    logit_softcap: the logits become ``tanh(l / c) * c`` (Laguna's router soft-capping).
    select_on_logits: top-k reads the logits (+ correction bias); the weights are the sigmoid of the selected
    logits (Kolibri).
    scatter_scores: with ``select_on_logits``, the score function runs on the [N, E] logits whose unselected entries
    are set to -inf (score 0), and the weights are read at the top-k (Llama 4's router scores; CPU elementwise
    kernels round by tensor size, so the [N, k] sigmoid of Kolibri would not be HF's bits).
    topk_softmax_fp32: the softmax over the top-k logits is taken in fp32 (Cohere2-MoE), else in the logits dtype.
    biased_group_fill: what groups dropped by group-limited selection get on a biased choice (AXK2: 0.0).
    logits_in_weight_dtype: the tokens are cast to the router weight's dtype before the matmul (MiniMax-M2,
    Hunyuan: an fp32-kept router weight gives fp32 logits).
    softmax_in_logits_dtype: the softmax over all experts is taken in the logits dtype (DBRX), else in fp32.
    renorm_p: renormalise by the top-k weights' p-norm instead of their sum (DBRX's moe_normalize_expert_weights).
    """

    score: str
    top_k: int
    num_experts: int
    logits_fp32: bool = False
    renormalize: bool = False
    renorm_eps: float = 0.0
    softmax_over_topk: bool = False
    scaling: float = 1.0
    n_group: int | None = None
    topk_group: int | None = None
    group_score: str = "max"
    group_fill: float = float("-inf")
    group_masks_weights: bool = False
    uses_correction_bias: bool = False
    weights_in_logits_dtype: bool = True
    sorted_topk: bool = True
    jitter_eps: float = 0.0
    logits_upcast: bool = False
    weights_in_input_dtype: bool = False
    renorm_min: float | None = None
    scores_fp32: bool = False
    logits_in_weight_dtype: bool = False
    logit_softcap: float | None = None
    select_on_logits: bool = False
    biased_group_fill: float = float("-inf")
    topk_softmax_fp32: bool = False
    scatter_scores: bool = False
    softmax_in_logits_dtype: bool = False
    renorm_p: float | None = None

    @property
    def normalises_topk(self) -> bool:
        """The top-k weights sum to a constant (``scaling``): renormalised by their sum (or 1-norm), or a softmax
        over the top-k."""
        return (self.renormalize and self.renorm_p in (None, 1.0)) or self.softmax_over_topk

    def __post_init__(self):
        if self.score not in SCORE_FUNCTIONS:
            raise ValueError(f"routing score must be one of {SCORE_FUNCTIONS}, got {self.score!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}: "
                "lower num_experts_per_tok in the model config"
            )
        if self.n_group:
            if self.num_experts % self.n_group:
                raise ValueError(f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
            if not self.topk_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(
                    f"topk_group={self.topk_group} must be between 1 and n_group={self.n_group}: "
                    "set topk_group in the model config"
                )
            reachable = self.topk_group * (self.num_experts // self.n_group)
            if self.top_k > reachable:  # HF accepts it: the rest of the top-k comes from masked scores
                warnings.warn(
                    f"top_k={self.top_k} exceeds the {reachable} experts reachable in topk_group="
                    f"{self.topk_group} groups: as in HF, the remaining experts are taken from the "
                    "masked (dropped) groups; raise topk_group or lower num_experts_per_tok to avoid it",
                    stacklevel=2,
                )
        if self.select_on_logits and self.score != "sigmoid":
            raise ValueError(f"select_on_logits needs an elementwise (sigmoid) score, got {self.score!r}")
        if self.scatter_scores and not self.select_on_logits:
            raise ValueError("scatter_scores reads the scores of the selected logits: it needs select_on_logits")
        if self.score == "sparsemixer" and self.top_k not in (1, 2):
            raise ValueError(f"sparsemixer routing (phimoe) is defined for top_k 1 or 2, got {self.top_k}: set "
                             "num_experts_per_tok to 1 or 2")


def router_logits(rule: RoutingRule, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Router logits [N, E] for flattened tokens ``x`` [N, H]."""
    if rule.logits_fp32:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    logits = F.linear(x.to(weight.dtype) if rule.logits_in_weight_dtype else x, weight, bias)
    if rule.logits_upcast:
        logits = logits.float()
    if rule.logit_softcap:
        logits = torch.tanh(logits / rule.logit_softcap) * rule.logit_softcap
    return logits


def scores_from_logits(rule: RoutingRule, logits: torch.Tensor) -> torch.Tensor:
    """Per-expert routing scores (probabilities for softmax routers, gates for sigmoid routers)."""
    if rule.score == "softmax":
        return torch.softmax(logits, dim=-1, dtype=logits.dtype if rule.softmax_in_logits_dtype else torch.float32)
    if rule.score == "sigmoid":
        return (logits.float() if rule.scores_fp32 else logits).sigmoid()
    if rule.score == "identity":
        return logits
    # sparsemixer's dense scores are the softmax over all experts
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def routing_probabilities(rule: RoutingRule, logits: torch.Tensor) -> torch.Tensor:
    """p_e(t) [N, E] fp32 of the MoE -> dense paper (scores, Eq. 6): the softmax over ALL E router logits
    (bias included: GPT-OSS's identity-score router too); for sigmoid routers (DeepSeek-V3) the sigmoid
    affinity of every expert (no correction bias, no renormalisation, no routed scaling)."""
    if rule.score == "sigmoid":
        return logits.float().sigmoid()
    return torch.softmax(logits.float(), dim=-1)


def _group_limit(
    rule: RoutingRule, choice: torch.Tensor, scores: torch.Tensor, forced: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's group-limited selection: keep each token's ``topk_group`` best groups of ``choice``.

    Returns ``(choice, scores)``: the choice with the dropped groups filled (``group_fill`` on the plain
    scores, as HF; -inf on a biased choice so that they stay below every kept expert) and the scores the
    weights are read from (zero outside the kept groups, forced experts excepted, where
    ``group_masks_weights``). Top-k then runs over ALL experts, as HF, so ``top_k`` may exceed the
    experts reachable in the kept groups.
    """
    grouped = choice.view(-1, rule.n_group, rule.num_experts // rule.n_group)
    if rule.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:  # "top2_sum"
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=rule.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    keep = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, rule.num_experts).bool()
    masked = choice.masked_fill(~keep, rule.group_fill if choice is scores else rule.biased_group_fill)
    has_forced = forced is not None and forced.numel() > 0
    if not rule.group_masks_weights:
        return masked, scores
    if choice is scores and not has_forced:
        return masked, masked  # HF (DeepSeek-V2): the weights are the top-k of the masked probabilities
    if has_forced:
        keep = keep.index_fill(1, forced.to(keep.device), True)
    return masked, scores.masked_fill(~keep, 0.0)


def topk_denominator(rule: RoutingRule, selected: torch.Tensor) -> torch.Tensor:
    """What a renormalising rule divides the selected weights [N, k] by: their sum (or p-norm, ``renorm_p``),
    clamped below at ``renorm_min``, plus ``renorm_eps``; [N, 1]."""
    if rule.renorm_p is None:
        denominator = selected.sum(dim=-1, keepdim=True)
    else:
        denominator = torch.norm(selected, p=rule.renorm_p, dim=-1, keepdim=True)
    if rule.renorm_min is not None:
        denominator = torch.clamp(denominator, min=rule.renorm_min)
    if rule.renorm_eps:
        denominator = denominator + rule.renorm_eps
    return denominator


def select_topk(
    rule: RoutingRule,
    logits: torch.Tensor,
    training: bool,
    correction_bias: torch.Tensor | None = None,
    selection_bias: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    top_k: int | None = None,
    bias_space: str = "logits",
    append: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ``(weights [N, k], indices [N, k])`` from router logits, following ``rule``.

    ``selection_bias`` [E] enters selection only (weights stay unbiased); ``bias_space`` says where.
    ``"logits"``: on the router's values before normalisation, S = TopK(s + b) - the raw logits when the
    rule normalises with a softmax over all experts, the scores when its score function is elementwise
    (sigmoid affinity, beside ``e_score_correction_bias``; identity: the logits themselves).
    ``"scores"``: on the scores (the probabilities of a softmax router).
    ``forced`` (expert ids) are put in every token's set; ``top_k`` overrides the set size (forced
    included). ``append`` (expert ids) are appended after every token's top-k, which stays over all experts,
    so an expert can appear twice (Expert Condenser's public code). Weights always come from the unbiased
    scores of the chosen set, renormalised over it.
    """
    if rule.score == "sparsemixer":
        from transformers.models.phimoe.modeling_phimoe import PhimoeMultiplier, sparsemixer

        if selection_bias is not None or forced is not None or top_k not in (None, rule.top_k):
            raise NotImplementedError("selection biases and forced experts are not defined for sparsemixer")
        if rule.top_k == 2:
            return sparsemixer(logits, jitter_eps=rule.jitter_eps, training=training, top_k=2)
        # top-1 (HF's sparsemixer ignores top_k and always returns 2 experts): the first-expert stage of HF's
        # sparsemixer, step for step and with the same random draws (jitter mask, Gumbel sample in training /
        # argmax in eval, softmax over the kept logits, Heun's third-order multiplier in training)
        with torch.no_grad():
            peak, argmax = logits.max(dim=-1, keepdim=True)
            dropped = ((peak - logits) / logits.abs().clamp(min=peak)) > (2 * rule.jitter_eps)
        masked = logits.masked_fill(dropped, float("-inf"))
        if training:
            noise = torch.empty_like(masked, memory_format=torch.legacy_contiguous_format).exponential_().log()
            chosen = (masked - noise).max(dim=-1)[1].unsqueeze(-1)
        else:
            chosen = argmax
        gates = torch.softmax(masked, dim=-1)
        weights = gates.gather(dim=-1, index=chosen)
        if training:
            top, top_index = gates.max(dim=-1, keepdim=True)
            heun = torch.logical_or(chosen == top_index, torch.rand_like(top) > 0.75)
            heun = torch.add(0.3333, heun, alpha=0.6667).type_as(gates)
            weights = PhimoeMultiplier.apply(logits, weights, chosen, gates, heun)
        return weights, chosen
    scores = scores_from_logits(rule, logits)
    choice = logits if rule.select_on_logits else scores
    corrected = rule.uses_correction_bias and correction_bias is not None
    if selection_bias is not None and bias_space not in BIAS_SPACES:
        raise ValueError(f"bias_space={bias_space!r}: choose one of {', '.join(BIAS_SPACES)}")
    # a softmax is not elementwise: the paper's s + b is taken before it, on the raw logits (l + b selects as
    # softmax(l + b) does); a correction bias on the probabilities (ERNIE 4.5) stays: softmax(l + b) + c
    before_softmax = selection_bias is not None and bias_space == "logits" and rule.score == "softmax"
    if before_softmax and corrected:
        choice = scores_from_logits(rule, logits + selection_bias)
    if corrected:
        choice = choice + correction_bias
    if selection_bias is not None and not (before_softmax and corrected):
        choice = (logits if before_softmax else choice) + selection_bias
    if rule.n_group:  # forced and appended experts keep their weights outside the kept groups
        choice, scores = _group_limit(rule, choice, scores, forced if forced is not None else append)
    if forced is not None and forced.numel():
        choice = choice.index_fill(1, forced.to(choice.device), float("inf"))
    top_choice, indices = torch.topk(choice, top_k or rule.top_k, dim=-1, sorted=rule.sorted_topk)
    if append is not None and append.numel():
        indices = torch.cat([indices, append.to(indices.device).expand(indices.shape[0], -1)], dim=1)
        weights = scores.gather(1, indices)
    elif rule.scatter_scores:  # the score of the [N, E] logits with -inf off the top-k, read at the top-k (Llama 4)
        unselected = torch.full_like(logits, float("-inf")).scatter(1, indices, logits.gather(1, indices))
        weights = scores_from_logits(rule, unselected).gather(1, indices)
    elif rule.select_on_logits:  # the score of the selected logits (as Kolibri: CPU sigmoid kernels round by size)
        weights = scores_from_logits(rule, logits.gather(1, indices))
    else:
        weights = top_choice if choice is scores else scores.gather(1, indices)
    if rule.softmax_over_topk:
        weights = torch.softmax(weights, dim=1, dtype=torch.float32 if rule.topk_softmax_fp32 else weights.dtype)
    if rule.renormalize:
        weights = weights / topk_denominator(rule, weights)
    if rule.scaling != 1.0:
        weights = weights * rule.scaling
    if rule.weights_in_logits_dtype:
        weights = weights.to(logits.dtype)
    return weights, indices
