"""Load-balancing losses moe-lab adds for families whose HF model computes none, and native coefficients.

Which loss a family uses and where its native coefficient lives are registry fields
(:class:`~moe_lab.moe.registry.FamilySpec` ``aux_loss``, ``aux_loss_field``, ``native_aux_loss_coef``):

- ``"hf"``: HF adds its own Switch loss (coefficient in the config field); nothing is added here.
- ``"sequence"``: DeepSeek's sequence-wise expert-level balance loss (DeepSeek-V2 paper, ``seq_aux=True`` in
  its modeling code; DeepSeek-V3's complementary sequence-wise loss on normalised sigmoid affinities).
- ``"switch"``: the Switch-Transformer loss on the recorded router logits (HF's formula).
"""

from __future__ import annotations

import torch

from .registry import config_value
from .routing import scores_from_logits, select_topk

AUX_LOSSES = ("hf", "sequence", "switch")
#: which tokens the Switch loss counts under data parallelism: "global" (every rank's: the single-process loss of the
#: global batch) or "per_rank" (each rank's own, as HF's model computes it inside a DDP / DeepSpeed run)
AUX_LOSS_SCOPES = ("global", "per_rank")


def native_aux_loss_coef(spec, config) -> float:
    """The family's own coefficient: the loaded config's ``spec.aux_loss_field`` (HF config-class default or
    the checkpoint's value), else the registry's ``native_aux_loss_coef``."""
    value = config_value(config, spec.aux_loss_field) if spec.aux_loss_field else None
    return float(spec.native_aux_loss_coef if value is None else value)


def sequence_balance_loss(router_logits, views, token_mask: torch.Tensor,
                          sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over MoE layers of ``mean_b sum_e f_{b,e} P_{b,e}`` over the real tokens of each sequence b:
    ``f_{b,e} = E / (K T_b) * #{t: e in top-k(t)}``, ``P_{b,e} = (1 / T_b) sum_t s_{t,e}``, with ``s`` the
    routing scores (softmax probabilities; sigmoid affinities normalised to sum 1) and ``T_b`` the real
    tokens of b. ``router_logits``: one [B*S, E] per MoE layer; ``token_mask`` [B, S]: 1 on real tokens;
    ``sequence_ids`` [B, S]: the document of each token within its row (packed rows), default one per row.
    Sequences without real tokens are left out."""
    logits = list(router_logits)
    if len(logits) != len(views):
        raise ValueError(f"got router logits of {len(logits)} layers for {len(views)} MoE layers")
    rows, width = token_mask.shape
    mask = token_mask.reshape(-1).bool()
    row = torch.arange(rows, device=mask.device).repeat_interleave(width)
    if sequence_ids is not None:
        sequence_ids = sequence_ids.to(mask.device).long()
        row = row * (int(sequence_ids.max()) + 1) + sequence_ids.reshape(-1)
    seq = row[mask]
    count = int(row.max()) + 1
    tokens = torch.bincount(seq, minlength=count).float()  # real tokens per sequence
    keep = tokens > 0
    total = None
    for view, layer_logits in zip(views, logits):
        rule = view.rule
        flat = layer_logits.reshape(-1, layer_logits.shape[-1])[mask.to(layer_logits.device)]
        seq = seq.to(flat.device)
        scores = scores_from_logits(rule, flat).float()
        if rule.score == "sigmoid":
            scores = scores / scores.sum(dim=-1, keepdim=True)
        _, indices = select_topk(rule, flat.detach(), False, view.correction_bias)
        selected = torch.zeros_like(scores).scatter_(1, indices, 1.0)
        counts = scores.new_zeros(count, rule.num_experts).index_add_(0, seq, selected)
        sums = scores.new_zeros(count, rule.num_experts).index_add_(0, seq, scores)
        n = tokens.to(flat.device).clamp(min=1).unsqueeze(1)
        f = counts * rule.num_experts / (rule.top_k * n)
        layer = (f * (sums / n)).sum(dim=1)[keep.to(flat.device)].mean()
        total = layer if total is None else total + layer
    return total


def switch_balance_loss(router_logits, num_experts: int, top_k: int, attention_mask=None,
                        over_ranks: bool = False) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss as HF's ``load_balancing_loss_func`` computes it (Mixtral's, which
    every ``aux_loss="hf"`` family's modeling code copies; bit for bit on one process): ``E sum_e f_e P_e`` with
    ``f_e`` the share of top-k assignments to e and ``P_e`` the mean router probability of e, both over every layer's
    (real, where ``attention_mask`` [B, S] is given) rows. ``over_ranks``: ``f`` and ``P`` over the rows of every
    process of the default group (the loss of the global batch); the value returned is that loss on every rank, and
    its gradient, averaged over the ranks as DDP averages, is the global loss's."""
    logits = tuple(router_logits)
    device = logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in logits:
        weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        ones = torch.ones(selected.numel(), dtype=torch.float32, device=device) if mask is None \
            else mask.repeat_interleave(top_k)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, selected.reshape(-1), ones)
        probs = probs + (weights.float().sum(dim=0) if mask is None else (weights.float() * mask[:, None]).sum(0))
        rows = rows + (weights.shape[0] if mask is None else mask.sum())
    world = torch.distributed.get_world_size() if over_ranks and torch.distributed.is_initialized() else 1
    if world == 1:
        return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * num_experts
    totals = torch.cat([counts, rows.view(1), probs.detach()])
    torch.distributed.all_reduce(totals)
    counts, rows, global_probs = totals[:num_experts], totals[num_experts], totals[num_experts + 1:]
    mine = torch.sum((counts / rows) * (probs / rows)) * num_experts * world  # this rank's part, times the world
    value = torch.sum((counts / rows) * (global_probs / rows)) * num_experts
    return mine + (value - mine).detach()


def added_aux_loss(patch, router_logits, token_mask: torch.Tensor,
                   sequence_ids: torch.Tensor | None = None, over_ranks: bool = False) -> torch.Tensor:
    """The load-balancing loss moe-lab adds for ``patch``'s family (registry ``aux_loss``), unscaled. ``over_ranks``:
    the Switch loss over every rank's tokens (:func:`switch_balance_loss`); the sequence-wise loss is per sequence."""
    kind = patch.spec.aux_loss
    if kind == "sequence":
        return sequence_balance_loss(router_logits, patch.views, token_mask, sequence_ids)
    if kind == "switch":
        layer = patch.layers[0]
        return switch_balance_loss(router_logits, layer.num_experts, layer.top_k, token_mask, over_ranks)
    raise ValueError(f"{patch.spec.model_type}: HF adds its own aux loss (aux_loss={kind!r})")
