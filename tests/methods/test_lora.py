"""LoRA on packed experts and linear targets: identity at init, only adapters train, merged export is
vanilla HF and reproduces the adapted model."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import moe_lab
from tests.conftest import ALL_FAMILIES, build_tiny, random_batch

ALL_TARGETS = ["experts", "shared_experts", "attention", "dense_mlp"]


def _train(model, steps=4, lr=1e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for step in range(steps):
        loss = model(**random_batch(seed=step % 2)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


# four steps on these; one step (enough to move every adapter) on every other supported family
STEPS = {"olmoe": 4, "qwen2_moe": 4, "deepseek_v2": 4, "gpt_oss": 4}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_lora_identity_at_init_trains_adapters_only_and_merges(family, tmp_path):
    base = build_tiny(family).train()
    model = copy.deepcopy(base)
    patch = moe_lab.apply(model, "sft", lora={"rank": 4, "alpha": 8, "targets": ALL_TARGETS})
    batch = random_batch()
    # the base with the adapted model's trainable set (torch's CPU conv1d picks its kernel by requires_grad: Jamba's
    # frozen Mamba conv otherwise rounds differently, 1e-6, with the same weights)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for n, p in base.named_parameters():
        p.requires_grad_(n in trainable)
    torch.manual_seed(0)
    ref = base(**batch).logits
    torch.manual_seed(0)
    assert torch.equal(model(**batch).logits, ref), "B = 0: the adapted model is the base model at init"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # the router's trained tensors: its weight and additive logit bias (not a selection-only correction bias)
    trained = {id(t) for view in patch.views for t in (view.router_weight, view.router_bias) if t is not None}
    routers = {n for n, p in model.named_parameters() if id(p) in trained}
    assert trainable - routers and all("lora_" in n for n in trainable - routers), sorted(trainable)[:5]
    assert routers <= trainable, "conventional SFT + LoRA trains the router full rank"
    assert any("experts" in n for n in trainable) and any("proj.lora" in n for n in trainable)
    frozen_before = {n: p.detach().clone() for n, p in base.named_parameters() if n not in routers}
    _train(model, steps=STEPS.get(family, 1))
    with patch.removed():
        names = dict(model.named_parameters())
    for n, before in frozen_before.items():
        if n not in names:  # a parametrized expert tensor (packed, or DBRX's experts.mlp.w1): its base tensor
            owner, _, leaf = n.rpartition(".")
            n = f"{owner}.parametrizations.{leaf}.original"
        assert torch.equal(names[n], before), f"base weight {n} changed"
    model.eval()
    with torch.no_grad():
        adapted = model(**batch).logits
    out = patch.export(tmp_path / "export")
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        merged = vanilla(**batch).logits
    assert not torch.allclose(merged, base.eval()(**batch).logits), "training changed the adapters"
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-5)


def _router_grads(model, patch) -> list:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    model(**random_batch()).loss.backward()
    return [view.router.weight.grad for view in patch.views]


def test_router_trainability_follows_the_method_under_lora():
    """DenseMixer paper: Conventional + LoRA and DenseMixer + LoRA train the router full rank (DenseMixer with its
    straight-through gradient), Frozen Router + LoRA does not. At init (B = 0) the adapted model is the base
    model, so each router gradient equals the method's own without LoRA on the same frozen-base model."""
    base = build_tiny("olmoe").train()
    grads = {}
    for method in ("sft", "densemixer", "frozen_router"):
        lora_model = copy.deepcopy(base)
        lora_patch = moe_lab.apply(lora_model, method, lora={"rank": 2, "targets": ALL_TARGETS})
        plain = copy.deepcopy(base)
        plain_patch = moe_lab.apply(plain, method)
        routers = {id(p) for view in plain_patch.views for p in view.router.parameters()}
        for p in plain.parameters():
            p.requires_grad_(p.requires_grad and id(p) in routers)  # the same frozen base, no adapters
        got = _router_grads(lora_model, lora_patch)
        if method == "frozen_router":
            assert all(g is None for g in got)
            assert not any(p.requires_grad for view in lora_patch.views for p in view.router.parameters())
            continue
        want = _router_grads(plain, plain_patch)
        assert all(g is not None and g.abs().sum() > 0 for g in got), method
        for g, w in zip(got, want):
            assert torch.equal(g, w), method
        grads[method] = got
    assert not any(torch.equal(a, b) for a, b in zip(grads["sft"], grads["densemixer"])), "STE differs from sft"


def test_lora_densemixer_router_and_adapters_train():
    model = build_tiny("olmoe").train()
    patch = moe_lab.apply(model, "densemixer", lora={"rank": 2, "targets": ["experts"]})
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n in trainable if "lora_" not in n} == {f"model.layers.{i}.mlp.gate.weight"
                                                         for i in (layer.index for layer in patch.layers)}
    losses = _train(model, steps=10)
    assert losses[-1] < losses[0]


def test_lora_condenser_keeps_its_bias_and_loss_falls():
    model = build_tiny("qwen3_moe").train()
    patch = moe_lab.apply(model, "condenser", n=0, gamma=1e-2, lora={"rank": 4, "targets": ["experts"]})
    losses = _train(model, steps=10)
    patch.update_biases()
    assert losses[-1] < losses[0] and patch.layers[0].bias.abs().sum() > 0


def test_lora_bad_options():
    with pytest.raises(ValueError, match="targets"):
        moe_lab.apply(build_tiny("olmoe"), "sft", lora={"targets": ["mlp"]})
    for router in ("router", "gate"):
        with pytest.raises(ValueError, match=r"method\.lora\.targets=.*names the router"):
            moe_lab.apply(build_tiny("olmoe"), "sft", lora={"targets": ["experts", router]})
    with pytest.raises(ValueError, match="method.lora.train_router is gone.*frozen_router"):
        moe_lab.apply(build_tiny("olmoe"), "sft", lora={"train_router": True})
    with pytest.raises(ValueError, match="dropout"):
        moe_lab.apply(build_tiny("olmoe"), "sft", lora={"dropout": 0.1, "targets": ["experts"]})
    with pytest.raises(TypeError, match="rnk"):
        moe_lab.apply(build_tiny("olmoe"), "sft", lora={"rnk": 4})


def test_lora_dropout_on_linear_targets_only_in_training():
    model = build_tiny("olmoe")
    moe_lab.apply(model, "sft", lora={"rank": 2, "dropout": 0.5, "targets": ["attention"]})
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p)
    batch = random_batch()
    model.eval()
    a, b = model(**batch).logits, model(**batch).logits
    assert torch.equal(a, b)
    model.train()
    torch.manual_seed(1)
    c = model(**batch).logits
    assert not torch.allclose(a, c)


def test_lora_on_esft_trains_only_the_selected_experts_adapters():
    from moe_lab.methods.slice_decay import sliced_weight_decay

    model = build_tiny("olmoe").train()
    layers = [layer.index for layer in moe_lab.apply(copy.deepcopy(model)).layers]
    patch = moe_lab.apply(model, "esft", experts={i: [1, 4] for i in layers}, lora={"rank": 2})
    assert not any(".lora." in n for n, _ in model.named_parameters()), "ESFT freezes attention: no adapter"
    masked = [p for p, _ in patch.expert_slice_masks.values()]
    assert masked and all(p.requires_grad for p in masked)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    sliced_weight_decay(opt, patch.expert_slice_masks.values(), 0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n and "experts" in n}
    for step in range(3):
        model(**random_batch(seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        if n in before:
            keep = [e for e in range(p.shape[0]) if e not in (1, 4)]
            assert torch.equal(p[keep], before[n][keep]), n
            if "lora_A" in n:
                assert not torch.equal(p[[1, 4]], before[n][[1, 4]]), n
