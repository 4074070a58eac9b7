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

    gc.collect()
    assert guard in set(esft._GUARDS)
    del guard, model
    gc.collect()
    assert not list(esft._GUARDS)
    plain = build_tiny("olmoe").train()  # no ESFT: decay moves every expert as usual
    before = plain.model.layers[0].mlp.experts.down_proj.detach().clone()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain(**random_batch()).loss.backward()
    optimizer.step()
    assert not torch.equal(plain.model.layers[0].mlp.experts.down_proj[5], before[5])
