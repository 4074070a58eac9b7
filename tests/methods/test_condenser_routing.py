"""Expert Condenser routing against an independent hand computation on the core families (every family it is
defined for, from its routing rule: test_condenser_families.py).

The oracle below reads only the HF config and router parameters (no moe-lab routing code): the paper's
S = TopK(s + b) (sigmoid routers: b on the affinity; GPT-OSS: on the logits), then the family's own
weight rule on the UNBIASED logits; and the two named variants (b on probabilities; b inside the softmax).
It is compared with the indices/weights the installed model records in a full forward pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_lab
from moe_lab.moe.view import find_moe_layers
from tests.conftest import build_tiny, random_batch

# every family the condenser supports (phimoe is refused), plus DeepSeek-V2's group-limited variant
CASES = ["olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v2_grouped", "deepseek_v3", "gpt_oss",
         "mixtral"]
MODES = [("logit_selection", 0, "replace"), ("logit_selection", 1, "replace"), ("logit_selection", 1, "append"),
         ("probability_selection", 0, "replace"), ("probability_selection", 1, "append"),
         ("inside_softmax", 0, "replace"), ("inside_softmax", 1, "replace"),
         ("inside_softmax", 1, "append_all"), ("logit_selection", 1, "append_all")]
FORCED = 3


def _model(case: str):
    if case == "deepseek_v2_grouped":
        return "deepseek_v2", build_tiny("deepseek_v2", topk_method="group_limited_greedy").eval()
    return case, build_tiny(case).eval()


def hand_route(family, config, router, x, b, mode, forced=(), top_k=None, appended=()):
    """(indices, weights) by hand from the HF config: the family's routing with the bias placed by ``mode``;
    ``appended`` experts join every token's top-k afterwards (the public code's budget: possibly twice)."""
    k = top_k or config.num_experts_per_tok
    deepseek = family.startswith("deepseek")
    if deepseek:  # DeepSeek routers compute their logits in fp32
        logits = F.linear(x.float(), router.weight.float())
    else:
        logits = F.linear(x, router.weight, router.bias if family == "gpt_oss" else None)
    if mode == "inside_softmax":
        logits = logits + b
    if family == "deepseek_v3":
        scores = logits.sigmoid()
        base = scores + router.e_score_correction_bias
    elif family == "gpt_oss":
        scores = base = logits
    else:
        scores = base = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if mode == "logit_selection":  # softmax routers: before the softmax; sigmoid / GPT-OSS: on the affinity
        key = (base if family in ("deepseek_v3", "gpt_oss") else logits) + b
    elif mode == "probability_selection":
        key = base + b
    else:
        key = base
    grouped = family == "deepseek_v3" or getattr(config, "topk_method", None) == "group_limited_greedy"
    if grouped:
        per_group = key.view(key.shape[0], config.n_group, -1)
        group_score = per_group.topk(2, dim=-1).values.sum(-1) if family == "deepseek_v3" else per_group.max(-1).values
        kept = torch.zeros_like(group_score, dtype=torch.bool)
        kept.scatter_(1, group_score.topk(config.topk_group, dim=-1).indices, True)
        key = key.masked_fill(~kept.repeat_interleave(per_group.shape[-1], dim=1), float("-inf"))
    key = key.clone()
    key[:, list(forced)] = float("inf")
    indices = key.topk(k, dim=-1).indices
    if appended:
        indices = torch.cat([indices, torch.tensor(appended).expand(indices.shape[0], -1)], dim=1)
    if family == "gpt_oss":
        weights = torch.softmax(logits.gather(1, indices), dim=1)
    else:
        weights = scores.gather(1, indices)
    renorm = {"mixtral": True, "deepseek_v2": False}.get(family, getattr(config, "norm_topk_prob", False))
    if renorm:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if family == "deepseek_v3" else 0.0))
    if deepseek:
        weights = weights * config.routed_scaling_factor
    return indices, weights


def _by_index(indices, weights):
    order = indices.argsort(dim=-1)
    return indices.gather(1, order), weights.gather(1, order)


def _record(patch):
    records = []
    for view in patch.views:
        view.router.register_forward_hook(lambda m, args, out: records.append((m, args[0], out[1], out[2])))
    return records


def _planted(patch, seed=0, scale=0.7):
    gen = torch.Generator().manual_seed(seed)
    for layer in patch.layers:
        layer.bias.copy_(torch.randn(layer.num_experts, generator=gen) * scale)
    return {layer.index: layer.bias.clone() for layer in patch.layers}


@pytest.mark.parametrize("mode,n,budget", MODES, ids=lambda v: str(v))
@pytest.mark.parametrize("case", CASES)
def test_installed_routing_equals_the_hand_computation(case, mode, n, budget):
    family, model = _model(case)
    layers = [v.index for v in find_moe_layers(model)]
    experts = {i: [FORCED] for i in layers} if n else None
    patch = moe_lab.apply(model, "condenser", bias_mode=mode, n=n, budget=budget, experts=experts)
    biases = _planted(patch)
    records = _record(patch)
    with torch.no_grad():
        model(**random_batch())
    assert len(records) == len(layers)
    changed, twice = 0, 0
    for (router, x, weights, indices), layer in zip(records, patch.layers):
        k = model.config.num_experts_per_tok + (n if budget == "append" else 0)
        forced = [FORCED] if n and budget != "append_all" else []
        appended = [FORCED] if budget == "append_all" else []
        want_i, want_w = _by_index(*hand_route(family, model.config, router, x, biases[layer.index], mode,
                                               forced, k, appended))
        twice += int(((indices == FORCED).sum(-1) == 2).sum())
        got_i, got_w = _by_index(indices, weights)
        assert torch.equal(got_i, want_i), f"{case} layer {layer.index}: selection differs"
        torch.testing.assert_close(got_w, want_w.to(got_w.dtype), rtol=0, atol=0)
        plain_i, _ = _by_index(*hand_route(family, model.config, router, x, torch.zeros_like(biases[layer.index]),
                                           mode, forced, k, appended))
        changed += int((plain_i != want_i).any(-1).sum())
    assert changed > 0, "the planted bias must change some selections (else this test could not fail)"
    if budget == "append_all":
        assert twice > 0, "some token has the condenser in its top-k as well: it counts twice"


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "mixtral", "deepseek_v2"])
def test_logit_and_probability_selection_differ_on_softmax_routers(family):
    picked = {}
    for mode in ("logit_selection", "probability_selection"):
        model = build_tiny(family).eval()
        patch = moe_lab.apply(model, "condenser", bias_mode=mode, n=0)
        _planted(patch, scale=0.05)
        records = _record(patch)
        with torch.no_grad():
            model(**random_batch())
        picked[mode] = torch.cat([_by_index(r[3], r[2])[0] for r in records])
    assert not torch.equal(picked["logit_selection"], picked["probability_selection"])


def test_sigmoid_router_bias_acts_like_hf_correction_bias():
    """DeepSeek-V3: the paper's b on the affinity equals HF's own router with e_score_correction_bias + b."""
    model = build_tiny("deepseek_v3").eval()
    patch = moe_lab.apply(model, "condenser", n=0)
    biases = _planted(patch, scale=0.3)
    router = patch.views[0].router
    hf_router = type(router).__mro__[1](model.config)
    hf_router.load_state_dict(router.state_dict())
    with torch.no_grad():
        hf_router.e_score_correction_bias += biases[patch.layers[0].index]
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, weights, indices = router(x)
        _, hf_weights, hf_indices = hf_router(x)
    got, want = _by_index(indices, weights), _by_index(hf_indices, hf_weights)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_unknown_bias_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="bias_mode='logits'.*logit_selection, probability_selection, inside_softmax"):
        moe_lab.apply(build_tiny("olmoe"), "condenser", bias_mode="logits")
    with pytest.raises(ValueError, match="bias_mode='selection' was renamed 'probability_selection'"):
        moe_lab.apply(build_tiny("olmoe"), "condenser", bias_mode="selection")
    with pytest.raises(ValueError, match="sparsemixer"):
        moe_lab.apply(build_tiny("phimoe"), "condenser")
