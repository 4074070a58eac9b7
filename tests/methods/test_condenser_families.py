"""Expert Condenser routing on every supported family it is defined for, against a hand computation written out
from the family's routing rule (the RoutingRule fields, not moe-lab's routing code), itself anchored to vanilla
HF: with no bias and no condensers it reproduces HF's own router on the same tokens.

``test_condenser_routing.py`` holds the per-family hand oracle of the core families (written from the HF
configs) and all nine (bias mode, n, budget) combinations; here each family runs three that cover every bias
mode and budget with a planted bias and a forced condenser, on one model build per family.
"""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch

import moe_lab
from moe_lab.moe.block import split_router_output
from tests.conftest import build_tiny, hf_route, method_families, random_batch

DEFINED, REFUSED = method_families("condenser")
# Llama 4 is top-1: there, budget="replace" with n=1 leaves no routed slot (the condenser alone), so its top-2
# variant is where a planted bias changes a replace-budget selection
CASES = [*DEFINED, "deepseek_v2_grouped", "llama4_text_top2"]
MODES = [("logit_selection", "append_all"), ("probability_selection", "replace"), ("inside_softmax", "append")]
EPS = torch.finfo(torch.float32).eps


def rule_route(rule, logits, correction, b, mode, forced=(), top_k=None, appended=()):
    """(indices, weights) by hand from ``rule``'s fields with the condenser bias ``b`` placed by ``mode``:
    ``logit_selection`` = the paper's S = TopK(s + b) with s the pre-normalisation router value (softmax routers:
    b inside the softmax, for selection only, beside a correction bias; elementwise scores: on the affinity),
    ``probability_selection`` = b on the scores, ``inside_softmax`` = b on the logits for selection and weights.
    ``forced`` experts are in every token's top-k; ``appended`` ones join after it."""
    k = top_k or rule.top_k
    logits = logits + b if mode == "inside_softmax" else logits

    def score(values):
        if rule.score == "softmax":
            return torch.softmax(values.float(), dim=-1)
        return values.float().sigmoid() if rule.score == "sigmoid" else values

    scores = score(logits)
    base = logits if rule.select_on_logits else scores
    corrected = rule.uses_correction_bias and correction is not None
    if mode == "logit_selection" and rule.score == "softmax":
        key = score(logits + b)
    else:
        key = base + b if mode in ("logit_selection", "probability_selection") else base
    if corrected:
        key = key + correction
    weight_scores = scores
    if rule.n_group:
        per_group = key.view(key.shape[0], rule.n_group, -1)
        group = (per_group.max(-1).values if rule.group_score == "max"
                 else per_group.topk(2, dim=-1).values.sum(-1))
        kept = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(rule.topk_group, dim=-1).indices,
                                                                   True)
        kept = kept.repeat_interleave(per_group.shape[-1], dim=1)
        # groups dropped from a choice that carries a bias (the condenser's, even zero, or a correction bias) are
        # filled with biased_group_fill; from the plain scores (inside_softmax: b is in the logits) with group_fill
        plain = mode == "inside_softmax" and not corrected and not rule.select_on_logits
        key = key.masked_fill(~kept, rule.group_fill if plain else rule.biased_group_fill)
        if rule.group_masks_weights:
            kept[:, list(forced) + list(appended)] = True
            weight_scores = scores.masked_fill(~kept, 0.0)
    key = key.clone()
    key[:, list(forced)] = float("inf")
    indices = key.topk(k, dim=-1).indices
    if appended:
        indices = torch.cat([indices, torch.tensor(appended).expand(indices.shape[0], -1)], dim=1)
    weights = weight_scores.gather(1, indices)
    if rule.softmax_over_topk:
        weights = torch.softmax(weights.float(), dim=-1)
    if rule.renormalize:
        total = weights.sum(-1, keepdim=True)
        total = total if rule.renorm_min is None else total.clamp(min=rule.renorm_min)
        weights = weights / (total + rule.renorm_eps)
    return indices, weights * rule.scaling


def _by_index(indices, weights):
    order = indices.argsort(dim=-1)
    return indices.gather(1, order), weights.gather(1, order).float()


def _model(case):
    if case == "deepseek_v2_grouped":
        return build_tiny("deepseek_v2", topk_method="group_limited_greedy").eval()
    if case == "llama4_text_top2":
        return build_tiny("llama4_text", num_experts_per_tok=2).eval()
    return build_tiny(case).eval()


def _routed(model, zero=False, **options):
    """Apply the condenser to a copy of ``model``, plant a bias (unless ``zero``), run a forward pass; per MoE layer
    (view, bias, router input, weights, indices)."""
    model = copy.deepcopy(model)
    patch = moe_lab.apply(model, "condenser", **options)
    records, handles = [], []
    for view, layer, bias in zip(patch.views, patch.layers, _planted(patch.layers)):
        layer.bias.copy_(bias * (0.0 if zero else 1.0))
        handles.append(view.router.register_forward_hook(lambda m, args, out, v=view, layer=layer: records.append(
            (v, layer.bias.clone(), args[0].reshape(-1, args[0].shape[-1]),
             *(t.reshape(-1, t.shape[-1]) for t in split_router_output(v.spec, out)[1:])))))
    with torch.no_grad():
        model(**random_batch())
    for handle in handles:
        handle.remove()
    assert len(records) == len(patch.layers)
    return records


def _planted(layers):
    """The bias planted in each layer (seeded)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(layer.num_experts, generator=gen) * 0.7 for layer in layers]


def _hf_logits(view, x):
    """Vanilla HF's (logits, weights, indices) on tokens ``x``: the router's state under its HF class (moe-lab's
    routed router subclasses it)."""
    router = object.__new__(type(view.router).__mro__[1])
    router.__dict__.update(view.router.__dict__)
    return hf_route(SimpleNamespace(spec=view.spec, block=view.block), router, x)


def _close(got, want, k):
    """Weights: the same few operations on the same values (a k-term sum at most) -> (k + 4) eps relative."""
    assert torch.allclose(got, want.to(got.dtype), rtol=(k + 4) * EPS, atol=(k + 4) * EPS * float(want.abs().max()))


@pytest.mark.parametrize("case", CASES)
def test_installed_routing_equals_the_rule_hand_computation(case):
    base = _model(case)
    # the oracle is HF's routing when nothing is planted or forced, and so is the installed condenser's (bias zero)
    # on the same tokens; each layer's condenser: the expert the planted bias's top-k picks most often (so that
    # append_all counts it twice for some token)
    forced_expert = {}
    unbiased = _routed(base, n=0, bias_mode="logit_selection", zero=True)
    for (view, _, x, weights, indices), bias in zip(unbiased, _planted([r[0] for r in unbiased])):
        zero = torch.zeros(view.num_experts)
        with torch.no_grad():
            logits, hf_w, hf_i = _hf_logits(view, x)
        hf = _by_index(hf_i, hf_w)
        for got in (_by_index(*rule_route(view.rule, logits, view.correction_bias, zero, "logit_selection")),
                    _by_index(indices, weights)):
            assert torch.equal(got[0], hf[0]), f"{case}: not HF's selection"
            _close(got[1], hf[1], view.top_k)
        picked = rule_route(view.rule, logits, view.correction_bias, bias, "logit_selection")[0]
        forced_expert[view.index] = int(torch.bincount(picked.flatten(), minlength=view.num_experts).argmax())
    twice = 0
    for mode, budget in MODES:
        changed = 0
        experts = {i: [e] for i, e in forced_expert.items()}
        for view, bias, x, weights, indices in _routed(base, n=1, bias_mode=mode, budget=budget, experts=experts):
            k = view.top_k + (1 if budget == "append" else 0)
            forced, appended = ([], experts[view.index]) if budget == "append_all" else (experts[view.index], [])
            with torch.no_grad():
                logits = _hf_logits(view, x)[0]
            want_i, want_w = _by_index(*rule_route(view.rule, logits, view.correction_bias, bias, mode, forced, k,
                                                   appended))
            got_i, got_w = _by_index(indices, weights)
            assert torch.equal(got_i, want_i), f"{case} {mode} {budget} layer {view.index}: selection differs"
            _close(got_w, want_w, k)
            plain_i, _ = _by_index(*rule_route(view.rule, logits, view.correction_bias, torch.zeros_like(bias), mode,
                                               forced, k, appended))
            changed += int((plain_i != want_i).any(-1).sum())
            twice += int(((indices == experts[view.index][0]).sum(-1) == 2).sum())
        no_routed_slot = budget == "replace" and view.top_k == 1  # n = k = 1: the condenser alone
        assert changed > 0 or no_routed_slot, f"{mode}: the planted bias must change some selections (else this " \
            "could not fail)"
    assert twice > 0, "append_all: some token has the condenser in its top-k as well, so it counts twice"


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_by_name_where_undefined(family):
    with pytest.raises(ValueError, match=re.escape(f"condenser is not defined for {family}: {REFUSED[family]}")):
        moe_lab.apply(build_tiny(family), "condenser")
