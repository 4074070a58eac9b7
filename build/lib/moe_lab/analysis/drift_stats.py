"""Routing drift between two routings of the same tokens: top-k overlap, flip rates, entropy, KL.

A :class:`RoutingSnapshot` holds one MoE layer's routing of a fixed set of real (non-pad) tokens: the
selected expert set of every token, the selected expert with the largest gate weight ("top-1") and the
log of the token's routing distribution over all experts. :func:`drift_sums` compares a snapshot with a
baseline snapshot of the same tokens and returns per-token *sums* (so they can be added across
data-parallel ranks before dividing), :func:`drift_means` turns them into the reported means:

* ``topk_overlap``: mean over tokens of ``|S_now & S_base| / max(|S_now|, |S_base|)``; with equal set
  sizes ``k`` that is ``|S_now & S_base| / k``. It is 1 exactly when every token keeps its expert set (a
  set that only grew, e.g. condenser experts appended, scores below 1).
* ``flip_rate``: fraction of tokens whose selected expert *set* changed (order ignored).
* ``top1_flip_rate``: fraction of tokens whose highest-weight selected expert changed.
* ``entropy``: mean token entropy (nats) of the routing distribution ``p`` over all experts.
* ``kl``: mean token ``KL(p_base || p_now)`` (nats).

The routing distribution ``p`` (:func:`routing_log_probs`): the softmax of the router logits for
softmax, sparsemixer and identity (top-k on raw logits, e.g. GPT-OSS) routers; for sigmoid routers
(DeepSeek-V3) the sigmoid gates normalised to sum 1. It is computed from the logits the router returns,
so a bias added for selection only (Expert Condenser's default, DeepSeek-V3's correction bias) moves
the expert sets but not ``p``; a bias inside the logits moves both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_lab.moe.routing import RoutingRule

__all__ = ["DRIFT_STATS", "RoutingSnapshot", "drift_means", "drift_sums", "routing_log_probs", "snapshot"]

# the reported statistics, in the order of the columns of :func:`drift_sums` (after the token count)
DRIFT_STATS = ("topk_overlap", "flip_rate", "top1_flip_rate", "entropy", "kl")


@dataclass
class RoutingSnapshot:
    """One layer's routing of ``N`` real tokens (CPU tensors)."""

    indices: torch.Tensor  # int64 [N, k]: the selected expert set of every token
    top1: torch.Tensor  # int64 [N]: the selected expert with the largest gate weight
    log_probs: torch.Tensor  # float32 [N, E]: log of the routing distribution over all experts

    @property
    def num_tokens(self) -> int:
        return int(self.indices.shape[0])

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"indices": self.indices, "top1": self.top1, "log_probs": self.log_probs}

    @classmethod
    def cat(cls, parts: list[RoutingSnapshot]) -> RoutingSnapshot:
        """The snapshots of several batches as one (tokens concatenated in order)."""
        if len({p.indices.shape[1] for p in parts}) > 1:
            raise ValueError("cannot concatenate snapshots with different expert-set sizes")
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("indices", "top1", "log_probs")))


def routing_log_probs(rule: RoutingRule, logits: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, E]`` log of the routing distribution (see the module docstring)."""
    logits = logits.detach().float()
    if rule.score == "sigmoid":
        gates = F.logsigmoid(logits)
        return gates - torch.logsumexp(gates, dim=-1, keepdim=True)
    return torch.log_softmax(logits, dim=-1)


def snapshot(
    rule: RoutingRule,
    logits: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    token_mask: torch.Tensor | None = None,
) -> RoutingSnapshot:
    """A router's output ``(logits [N, E], weights [N, k], indices [N, k])`` restricted to the tokens
    where the flat ``token_mask`` [N] is non-zero (all tokens when None), moved to the CPU."""
    if indices.dim() != 2 or weights.shape != indices.shape or logits.shape[0] != indices.shape[0]:
        raise ValueError(
            f"expected router logits [N, E], weights [N, k] and indices [N, k], got {tuple(logits.shape)}, "
            f"{tuple(weights.shape)}, {tuple(indices.shape)}"
        )
    top1 = indices.gather(1, weights.detach().float().argmax(dim=1, keepdim=True)).squeeze(1)
    log_probs = routing_log_probs(rule, logits)
    if token_mask is not None:
        keep = token_mask.reshape(-1).to(indices.device).bool()
        if keep.numel() != indices.shape[0]:
            raise ValueError(f"token mask has {keep.numel()} entries for {indices.shape[0]} routed tokens")
        indices, top1, log_probs = indices[keep], top1[keep], log_probs[keep]
    return RoutingSnapshot(indices.detach().long().cpu(), top1.detach().long().cpu(), log_probs.cpu())


def _membership(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    member = torch.zeros(indices.shape[0], num_experts, dtype=torch.bool)
    return member.scatter_(1, indices, True)


def drift_sums(base: RoutingSnapshot, now: RoutingSnapshot) -> torch.Tensor:
    """float64 ``[1 + len(DRIFT_STATS)]``: the token count, then the per-token sums of every statistic."""
    if base.num_tokens != now.num_tokens or base.log_probs.shape != now.log_probs.shape:
        raise ValueError(
            f"snapshots of different tokens: {tuple(base.log_probs.shape)} vs {tuple(now.log_probs.shape)}"
        )
    num_experts = base.log_probs.shape[1]
    in_base, in_now = _membership(base.indices, num_experts), _membership(now.indices, num_experts)
    size = torch.maximum(in_base.sum(1), in_now.sum(1)).double()
    overlap = (in_base & in_now).sum(1).double() / size
    set_flip = (in_base != in_now).any(1).double()
    top1_flip = (base.top1 != now.top1).double()
    lp_base, lp_now = base.log_probs.double(), now.log_probs.double()
    entropy = -(lp_now.exp() * lp_now).sum(1)
    kl = (lp_base.exp() * (lp_base - lp_now)).sum(1)
    columns = [overlap, set_flip, top1_flip, entropy, kl]
    return torch.stack([torch.tensor(float(base.num_tokens), dtype=torch.float64)] + [c.sum() for c in columns])


def drift_means(sums: torch.Tensor) -> dict[str, float]:
    """``{statistic: mean over tokens}`` from (possibly rank-summed) :func:`drift_sums`; nan without tokens."""
    sums = sums.detach().double().cpu()
    count = float(sums[0])
    return {name: float(sums[i + 1]) / count if count else float("nan") for i, name in enumerate(DRIFT_STATS)}
