"""ESFT through the plain API: unselected expert slices stay bit-identical under plain torch optimizers
(no Lightning), with their default or explicit weight decay and momentum; selected slices move."""

from __future__ import annotations

import pytest
import torch

import moe_lab
from moe_lab.moe.view import find_moe_layers
from tests.conftest import build_tiny, random_batch

OPTIMIZERS = {
    "adamw_default_wd": lambda params: torch.optim.AdamW(params, lr=1e-2),  # weight_decay=0.01 by default
    "sgd_momentum_wd": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9, weight_decay=0.1),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adam_l2": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.1),
    "asgd": lambda params: torch.optim.ASGD(params, lr=1e-2),  # decays every entry even at weight_decay=0
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_plain_loop_keeps_unselected_slices_bit_identical(name):
    model = build_tiny("olmoe").train()
    layers = [v.index for v in find_moe_layers(model)]
    experts = {layers[0]: [1, 6], layers[1]: [3]}
    moe_lab.apply(model, "esft", experts=experts)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = OPTIMIZERS[name](model.parameters())  # every parameter, as a TRL / hand-written loop passes them
    for step in range(4):
        model(**random_batch(seed=step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = 0
    for pname, param in model.named_parameters():
        if ".experts." not in pname:
            assert torch.equal(param, before[pname]), pname
            continue
        layer = int(pname.split(".")[2])
        for e in range(param.shape[0]):
            same = torch.equal(param[e], before[pname][e])
            assert same == (e not in experts[layer]), f"{pname}[{e}]"
            moved += not same
    assert moved == 2 * 3  # gate_up_proj and down_proj of the 3 selected experts


def test_guard_lives_with_the_model_and_other_models_are_untouched():
    from moe_lab.methods import esft

    model = build_tiny("olmoe")
    guard = moe_lab.apply(model, "esft", experts={0: [0]}).frozen_slice_guard  # the patch itself is dropped
    import gc
    import weakref

    gc.collect()
    assert guard in set(esft._GUARDS)
    alive = weakref.ref(guard)
    del guard, model
    gc.collect()
    assert alive() is None  # this model's guard went with it (another test's model may still hold its own)
    plain = build_tiny("olmoe").train()  # no ESFT: decay moves every expert as usual
    before = plain.model.layers[0].mlp.experts.down_proj.detach().clone()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain(**random_batch()).loss.backward()
    optimizer.step()
    assert not torch.equal(plain.model.layers[0].mlp.experts.down_proj[5], before[5])


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "mixtral",
                                    "phimoe", "qwen3_moe", pytest.param("dbrx", marks=pytest.mark.slow)])
def test_frozen_expert_mixture_equals_conventional_bit_for_bit(family):
    """ESFT's mixer (frozen experts' pairs on detached weights) against the conventional mixture under the
    same selection and gradient masks: loss and every gradient bit-identical, on every family."""
    from moe_lab.methods.esft import FrozenExpertsMixture
    from moe_lab.moe.block import sparse_mixture

    base = build_tiny(family).train()
    experts = {v.index: [0, 3] for v in find_moe_layers(base)}
    ours, conventional = moe_lab.apply(base, "esft", experts=experts), None
    reference = build_tiny(family).train()
    conventional = moe_lab.apply(reference, "esft", experts=experts)
    assert all(isinstance(layer.mixer, FrozenExpertsMixture) for layer in ours.layers)
    for layer in conventional.layers:
        layer.mixer = sparse_mixture
    batch = random_batch()
    losses = []
    for model in (base, reference):
        torch.manual_seed(0)
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    grads = dict(reference.named_parameters())
    for name, param in base.named_parameters():
        assert (param.grad is None) == (grads[name].grad is None), name
        if param.grad is not None:
            assert torch.equal(param.grad, grads[name].grad), name


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", pytest.param("dbrx", marks=pytest.mark.slow)])
def test_frozen_experts_get_no_weight_gradient_at_all(family):
    """On a fully trainable block (no gradient masks), the mixer's frozen experts receive exactly zero
    weight gradient (it is never computed), the trained experts and the input get the conventional ones."""
    from moe_lab.methods.esft import FrozenExpertsMixture

    base = build_tiny(family).train()
    ours, reference = moe_lab.apply(base, "sft"), moe_lab.apply(build_tiny(family).train(), "sft")
    trained = torch.zeros(8, dtype=torch.bool)
    trained[[1, 6]] = True
    ours.layers[0].mixer = FrozenExpertsMixture(trained)
    x = torch.randn(3, 9, base.config.hidden_size, generator=torch.Generator().manual_seed(0))
    g = torch.randn_like(x)
    inputs = []
    for patch in (ours, reference):
        xi = x.clone().requires_grad_(True)
        out = patch.layers[0](xi)
        ((out[0] if isinstance(out, tuple) else out) * g).sum().backward()
        inputs.append(xi.grad)
    torch.testing.assert_close(inputs[0], inputs[1], rtol=0, atol=0)
    theirs = dict(reference.layers[0].experts.named_parameters())
    for name, param in ours.layers[0].experts.named_parameters():
        rows = trained.repeat_interleave(param.shape[0] // 8)  # DBRX: expert e owns I rows of [E*I, H]
        assert torch.equal(param.grad[~rows], torch.zeros_like(param.grad[~rows])), name
        assert torch.equal(param.grad[rows], theirs[name].grad[rows]), name
        assert theirs[name].grad[~rows].abs().sum() > 0, name
