"""DenseMixer against a dense autograd oracle (DESIGN.md, "Methods, precisely")."""

from __future__ import annotations

import copy

import pytest
import torch

import moe_lab
from moe_lab.methods.densemixer import dense_weights
from tests.conftest import build_tiny, random_batch


def _hf_expert_output(experts, x, e):
    """Expert e on every token, computed by the HF packed-experts module itself (weight 1)."""
    n = x.shape[0]
    return experts(x, torch.full((n, 1), e, dtype=torch.long), torch.ones(n, 1, dtype=x.dtype))


def _oracle_dense_weights(family, logits, indices, config):
    """The dense weights written out per family, independently of the routing code."""
    selected = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, True)
    if family == "olmoe" or family == "qwen2_moe":  # softmax, no renormalisation
        return torch.softmax(logits.float(), dim=-1)
    if family == "qwen3_moe" or family == "mixtral":  # softmax, renormalised over the top-k
        p = torch.softmax(logits.float(), dim=-1)
        s = (p * selected).sum(-1, keepdim=True)
        return torch.where(selected, p / s, p / s.detach())
    if family == "deepseek_v3":  # sigmoid, renormalised, routed scaling
        p = torch.sigmoid(logits.float())
        s = (p * selected).sum(-1, keepdim=True) + 1e-20
        return torch.where(selected, p / s, p / s.detach()) * config.routed_scaling_factor
    if family == "gpt_oss":  # softmax over the top-k logits, extended with a stop-grad normaliser
        ex = torch.exp(logits.float())  # tiny logits: no max-subtraction needed
        z = (ex * selected).sum(-1, keepdim=True)
        return torch.where(selected, ex / z, ex / z.detach())
    raise AssertionError(family)


ORACLE_FAMILIES = ["olmoe", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("family", ORACLE_FAMILIES)
def test_block_matches_dense_autograd_oracle(family):
    vanilla = build_tiny(family).train()
    ours = copy.deepcopy(vanilla)
    patch = moe_lab.apply(ours, "densemixer")
    block = patch.layers[0]
    hf_block = patch.views[0].block  # the vanilla block object shares the parameters ...
    hf_block = copy.deepcopy(hf_block)  # ... so the oracle gets its own copy
    hf_router_cls = type(vanilla.get_submodule(patch.views[0].name + "." + patch.spec.router_attr))
    getattr(hf_block, patch.spec.router_attr).__class__ = hf_router_cls

    gen = torch.Generator().manual_seed(3)
    hidden = vanilla.config.hidden_size
    x = torch.randn(2, 7, hidden, generator=gen)
    g = torch.randn(2, 7, hidden, generator=gen)

    # moe-lab DenseMixer
    x1 = x.clone().requires_grad_(True)
    y1 = block(x1)
    y1 = y1[0] if isinstance(y1, tuple) else y1
    (y1 * g).sum().backward()

    # oracle: <g, y_hf> + sum over inactive (token, expert) of w_dense * <g, E_e(x)>.detach()
    x2 = x.clone().requires_grad_(True)
    y2 = hf_block(x2)
    y2 = y2[0] if isinstance(y2, tuple) else y2
    flat = x2.reshape(-1, hidden)
    router = getattr(hf_block, patch.spec.router_attr)
    logits = torch.nn.functional.linear(flat.float() if family.startswith("deepseek") else flat,
                                        router.weight, getattr(router, "bias", None))
    _, _, indices = router(flat)
    with torch.no_grad():
        contrib = torch.stack(
            [(g.reshape(-1, hidden) * _hf_expert_output(hf_block.experts, flat, e)).sum(-1)
             for e in range(block.num_experts)], dim=1)
    w = _oracle_dense_weights(family, logits, indices, vanilla.config)
    inactive = torch.ones_like(w, dtype=torch.bool).scatter_(1, indices, False)
    ((y2 * g).sum() + (w * contrib * inactive).sum()).backward()

    assert torch.equal(y1, y2), "forward value must equal the conventional top-k output bit for bit"
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    ours_params = dict(block.named_parameters())
    for name, q in hf_block.named_parameters():
        p = ours_params[name]
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    router_grad = getattr(block, patch.spec.router_attr).weight.grad
    assert router_grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_expert_gradients_equal_conventional_given_same_output_gradient(family):
    """With the same dL/dy at the layer, expert (and shared-expert) gradients are the conventional ones,
    while the router gradient differs (it now sees every expert)."""
    base = build_tiny(family).train()
    conv, dm = copy.deepcopy(base), copy.deepcopy(base)
    p_conv, p_dm = moe_lab.apply(conv, "sft"), moe_lab.apply(dm, "densemixer")
    x = torch.randn(3, 5, base.config.hidden_size, generator=torch.Generator().manual_seed(0))
    g = torch.randn_like(x)
    for patch in (p_conv, p_dm):
        (patch.layers[0](x) * g).sum().backward()
    a, b = dict(p_conv.layers[0].named_parameters()), dict(p_dm.layers[0].named_parameters())
    for name, param in a.items():
        if "experts" in name:
            assert torch.equal(param.grad, b[name].grad), name
    router = p_conv.spec.router_attr
    assert not torch.allclose(a[f"{router}.weight"].grad, b[f"{router}.weight"].grad)


def test_dense_weights_equal_conventional_weights_at_selected_experts(family):
    if family == "phimoe":
        pytest.skip("densemixer is not defined for sparsemixer routing")
    model = build_tiny(family)
    patch = moe_lab.apply(model, "sft")
    view = patch.views[0]
    x = torch.randn(11, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits, weights, indices = view.router(x)
    torch.testing.assert_close(dense_weights(view.rule, logits, indices).gather(1, indices), weights,
                               rtol=1e-6, atol=1e-7)


def test_model_loss_is_bit_identical_and_router_gets_more_gradient():
    base = build_tiny("qwen2_moe").train()
    conv, dm = copy.deepcopy(base), copy.deepcopy(base)
    moe_lab.apply(conv, "sft")
    moe_lab.apply(dm, "densemixer")
    batch = random_batch()
    out_c, out_d = conv(**batch), dm(**batch)
    assert torch.equal(out_c.logits, out_d.logits)
    out_c.loss.backward()
    out_d.loss.backward()
    # shared experts are untouched by DenseMixer: no straight-through term reaches them directly
    gc = conv.model.layers[0].mlp.gate.weight.grad
    gd = dm.model.layers[0].mlp.gate.weight.grad
    assert not torch.allclose(gc, gd)


def test_chunking_does_not_change_gradients():
    base = build_tiny("olmoe").train()
    grads = []
    for budget in (1e-4, 256.0):  # ~1 token per chunk vs everything at once
        model = copy.deepcopy(base)
        moe_lab.apply(model, "densemixer", memory_budget_mb=budget)
        model(**random_batch()).loss.backward()
        grads.append(model.model.layers[0].mlp.gate.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-8)


def test_rejects_sparsemixer_and_bad_budget():
    with pytest.raises(ValueError, match="sparsemixer"):
        moe_lab.apply(build_tiny("phimoe"), "densemixer")
    with pytest.raises(ValueError, match="memory_budget_mb"):
        moe_lab.apply(build_tiny("olmoe"), "densemixer", memory_budget_mb=0)
