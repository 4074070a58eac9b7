"""Expert Condenser: bias updates against hand-computed loads, forced experts, DDP, state files."""

from __future__ import annotations

import copy
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_lab
from moe_lab.methods.condenser import STATE_FILE, save_condenser_state
from tests.conftest import build_tiny, random_batch

GAMMA = 0.01


def _hf_topk(router_cls, router, x):
    """Indices and weights of the vanilla HF router class on ``x`` (independent of moe-lab routing)."""
    vanilla = copy.copy(router)
    vanilla.__class__ = router_cls
    _, weights, indices = vanilla(x)
    return weights, indices


def _first_block(family="olmoe", **options):
    model = build_tiny(family).train()
    router_cls = type(model.get_submodule(moe_lab.apply(copy.deepcopy(model), "sft").views[0].name).gate) \
        if family != "gpt_oss" else None
    patch = moe_lab.apply(model, "condenser", **options)
    return model, patch, patch.layers[0], router_cls


@pytest.mark.parametrize("sign", ["sparsify", "balance"])
def test_bias_update_signs_follow_hand_computed_loads(sign):
    model, patch, block, router_cls = _first_block(gamma=GAMMA, sign=sign, n=0)
    x = torch.randn(4, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    block(x)
    _, indices = _hf_topk(router_cls, block.gate, x.reshape(-1, x.shape[-1]))
    load = torch.bincount(indices.reshape(-1), minlength=block.num_experts).double()
    assert torch.equal(patch.counts()[0], load.long())
    patch.update_biases()
    direction = -1.0 if sign == "sparsify" else 1.0
    expected = GAMMA * direction * torch.sign(load.mean() - load)
    torch.testing.assert_close(block.bias, expected.float(), rtol=0, atol=0)
    # above-mean experts: sparsify raises their bias (rich get richer), balance lowers it
    busiest = int(load.argmax())
    assert (block.bias[busiest] > 0) == (sign == "sparsify")
    assert int(patch.counts().sum()) == 0, "loads reset after an update"
    assert int(block.bias_updates) == 1


def test_center_keeps_zero_mean():
    model, patch, block, _ = _first_block(gamma=GAMMA, center=True, n=0)
    for seed in range(3):
        block(torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)))
        patch.update_biases()
    assert abs(float(block.bias.mean())) < 1e-7
    assert block.bias.abs().max() > 0


def test_selection_bias_changes_choice_not_weights():
    model, _patch, block, _cls = _first_block(n=0)
    x = torch.randn(30, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    block.bias[5] = 100.0  # expert 5 is chosen by every token ...
    logits, weights, indices = block.gate(x)
    assert (indices == 5).any(-1).all()
    probs = torch.softmax(logits.float(), -1)  # ... with its unbiased softmax weight (olmoe: no renorm)
    torch.testing.assert_close(weights, probs.gather(1, indices))


def test_inside_softmax_mode_puts_bias_inside_the_softmax():
    model, _patch, block, _ = _first_block(n=0, bias_mode="inside_softmax")
    x = torch.randn(30, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    block.bias[5] = 3.0
    _logits, weights, indices = block.gate(x)
    raw = torch.nn.functional.linear(x, block.gate.weight)
    probs = torch.softmax(raw + block.bias, -1)
    torch.testing.assert_close(weights, probs.gather(1, indices))


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("budget", ["replace", "append"])
def test_condensers_in_every_tokens_set(family, budget):
    model = build_tiny(family).train()
    patch = moe_lab.apply(model, "condenser", n=1, budget=budget,
                          experts={layer.index: [3] for layer in moe_lab.apply(copy.deepcopy(model)).layers})
    block = patch.layers[0]
    assert block.forced_experts == [3]
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    _, _, indices = getattr(block, patch.spec.router_attr)(x)
    k = block.top_k
    assert indices.shape[1] == (k if budget == "replace" else k + 1)
    assert (indices == 3).sum(-1).eq(1).all(), "every token has the condenser exactly once"
    assert (indices.sort(-1).values.diff(dim=-1) > 0).all(), "no expert twice"
    out = model(**random_batch())
    assert torch.isfinite(out.loss)


def test_condenser_weight_is_its_router_weight_renormalised_over_the_set():
    model = build_tiny("qwen3_moe").train()  # renormalised top-k
    layers = [layer.index for layer in moe_lab.apply(copy.deepcopy(model)).layers]
    patch = moe_lab.apply(model, "condenser", n=1, experts={i: [6] for i in layers})
    block = patch.layers[0]
    x = torch.randn(20, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    logits, weights, indices = block.gate(x)
    p = torch.softmax(logits.float(), -1)
    expected = p.gather(1, indices) / p.gather(1, indices).sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected.to(weights.dtype))


def test_in_run_choice_takes_lowest_bias_and_freezes_their_bias():
    model, patch, block, _ = _first_block(gamma=GAMMA, n=2, selection="in_run", selection_updates=3)
    batch = random_batch(batch=4, seq=12)
    for _ in range(3):
        assert block.forced_experts == []
        model(**batch)
        patch.update_biases()
    bias, used = block.bias.tolist(), block.usage.tolist()  # biases are multiples of gamma: ties are common
    expected = sorted(sorted(range(block.num_experts), key=lambda e: (bias[e], used[e]))[:2])
    assert block.forced_experts == expected
    frozen = block.bias[expected].clone()
    model(**batch)
    patch.update_biases()
    assert torch.equal(block.bias[expected], frozen)


@pytest.mark.parametrize("rule", ["most_used", "least_used", "highest_bias"])
def test_other_selection_rules(rule):
    model, patch, block, _ = _first_block(gamma=GAMMA, n=1, selection="in_run", selection_updates=2, select=rule)
    total = torch.zeros(block.num_experts, dtype=torch.long)
    for seed in range(2):
        model(**random_batch(batch=4, seq=12, seed=seed))
        total += patch.counts()[0]
        patch.update_biases()
    assert torch.equal(block.usage, total.double()), "usage = the loads summed while the biases learn"
    bias, used = block.bias.tolist(), total.tolist()
    # sparsify: the bias rises with usage, so each key's ties are broken by the other in the same direction
    key = {"most_used": lambda e: (-used[e], -bias[e]), "least_used": lambda e: (used[e], bias[e]),
           "highest_bias": lambda e: (-bias[e], -used[e])}[rule]
    assert block.forced_experts == [min(range(block.num_experts), key=key)]


def test_state_file_round_trip_and_export(tmp_path):
    model, patch, block, _ = _first_block(gamma=GAMMA, n=2, selection="in_run", selection_updates=2)
    for seed in range(2):
        model(**random_batch(seed=seed))
        patch.update_biases()
    path = save_condenser_state(patch, tmp_path / "state.json")
    fresh = build_tiny("olmoe")
    again = moe_lab.apply(fresh, "condenser", bias_file=str(path), n=2)
    assert again.layers[0].forced_experts == block.forced_experts
    assert torch.equal(again.layers[0].bias, block.bias)
    out = patch.export(tmp_path / "export")
    saved = json.loads((out / STATE_FILE).read_text())
    assert saved["layers"][str(block.index)]["forced_experts"] == block.forced_experts


def test_bad_options_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="sign"):
        moe_lab.apply(build_tiny("olmoe"), "condenser", sign="up")
    with pytest.raises(ValueError, match="budget"):
        moe_lab.apply(build_tiny("olmoe"), "condenser", n=3)  # top_k=2
    with pytest.raises(ValueError, match="selection_updates=0 would choose the condensers from all-zero biases"):
        moe_lab.apply(build_tiny("olmoe"), "condenser", selection_updates=0)
    with pytest.raises(ValueError, match="sparsemixer"):
        moe_lab.apply(build_tiny("phimoe"), "condenser")
    other = build_tiny("qwen3_moe")
    p = moe_lab.apply(other, "condenser", n=0)
    path = save_condenser_state(p, tmp_path / "q.json")
    with pytest.raises(ValueError, match=r"q\.json.*holds biases of a qwen3_moe model.*this deepseek_v3 model"):
        moe_lab.apply(build_tiny("deepseek_v3"), "condenser", bias_file=str(path))
    with pytest.raises(ValueError, match="load='hard'.*count, soft, soft_all_tokens"):
        moe_lab.apply(build_tiny("olmoe"), "condenser", load="hard")
    with pytest.raises(ValueError, match="select='lowest'.*lowest_bias"):
        moe_lab.apply(build_tiny("olmoe"), "condenser", select="lowest")
    for old in ("warmup_steps", "warmup_trains_weights"):  # the in-run frozen warm-up is gone
        with pytest.raises(TypeError, match=rf"unknown option\(s\) \['{old}'\].*'selection', 'selection_updates'"):
            moe_lab.apply(build_tiny("olmoe"), "condenser", **{old: 1})
    for field, bad in (("selection", "warmup"), ("condenser_bias", "fixed"), ("update_every", "step")):
        with pytest.raises(ValueError, match=f"condenser {field}='{bad}': choose one of"):
            moe_lab.apply(build_tiny("olmoe"), "condenser", **{field: bad})


@pytest.mark.parametrize("overrides,holds,has", [
    ({"num_hidden_layers": 3}, "{0: 8 experts, 1: 8 experts}", "{0: 8 experts, 1: 8 experts, 2: 8 experts}"),
    ({"num_experts": 16}, "{0: 8 experts, 1: 8 experts}", "{0: 16 experts, 1: 16 experts}"),
])
def test_bias_file_of_another_layer_or_expert_count_is_refused(tmp_path, overrides, holds, has):
    path = save_condenser_state(moe_lab.apply(build_tiny("olmoe"), "condenser", n=0), tmp_path / "olmoe.json")
    with pytest.raises(ValueError) as err:
        moe_lab.apply(build_tiny("olmoe", **overrides), "condenser", bias_file=str(path))
    message = str(err.value)
    assert str(path) in message and f"olmoe model with MoE layers {holds}" in message
    assert f"this olmoe model has MoE layers {has}" in message


# --- data parallel -------------------------------------------------------------------------------


def _ddp_worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for load in ("count", "soft"):
        model = build_tiny("olmoe").train()
        patch = moe_lab.apply(model, "condenser", gamma=GAMMA, n=1, selection="in_run", selection_updates=2, load=load)
        for seed in range(3):
            batch = random_batch(batch=4, seq=12, seed=seed)
            model(**{k: v[rank::world] for k, v in batch.items()})
            patch.update_biases()
        torch.save({"bias": patch.layers[0].bias, "forced": patch.layers[0].forced_experts,
                    "usage": patch.layers[0].usage}, os.path.join(out_dir, f"{load}_rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_biases_identical_and_equal_to_one_process_on_the_global_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path)), nprocs=2)
    for load in ("count", "soft"):
        r0, r1 = (torch.load(tmp_path / f"{load}_rank{r}.pt") for r in (0, 1))
        assert torch.equal(r0["bias"], r1["bias"]) and r0["forced"] == r1["forced"]
        assert torch.equal(r0["usage"], r1["usage"])
        model = build_tiny("olmoe").train()
        patch = moe_lab.apply(model, "condenser", gamma=GAMMA, n=1, selection="in_run", selection_updates=2, load=load)
        for seed in range(3):
            model(**random_batch(batch=4, seq=12, seed=seed))
            patch.update_biases()
        assert torch.equal(patch.layers[0].bias, r0["bias"]), load
        assert patch.layers[0].forced_experts == r0["forced"]
        if load == "count":
            assert torch.equal(patch.layers[0].usage, r0["usage"])
        else:  # float64 sums of <= 2 x 48 fp32 probabilities (each < 1), added in another order
            torch.testing.assert_close(patch.layers[0].usage, r0["usage"], rtol=0, atol=1e-12)


# --- Lightning: per-optimizer-step updates, checkpoints --------------------------------------------


def _module():
    from moe_lab.methods.base import MoELightningModule

    return MoELightningModule(build_tiny("olmoe"), method="condenser",
                              options={"gamma": GAMMA, "n": 1, "selection": "in_run", "selection_updates": 2}, optim={"lr": 1e-3})


def _fit(module, max_steps, tmp_path, ckpt_path=None, accumulate=1, callbacks=()):
    import lightning as L
    from torch.utils.data import DataLoader

    batches = [random_batch(batch=2, seq=10, seed=s) for s in range(4)]
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
                        accumulate_grad_batches=accumulate, callbacks=list(callbacks))
    trainer.fit(module, DataLoader(batches * 4, batch_size=None), ckpt_path=ckpt_path)
    return trainer


def test_one_update_per_optimizer_step_with_gradient_accumulation(tmp_path):
    module = _module()
    _fit(module, 3, tmp_path, accumulate=2)
    assert int(module.patch.layers[0].bias_updates) == 3
    assert module.patch.layers[0].forced_experts, "condensers chosen after the 2-step warm-up"


def test_resume_restores_biases_condensers_and_step(tmp_path):
    import lightning as L

    module = _module()
    trainer = _fit(module, 3, tmp_path)
    ckpt = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = [(layer.bias.clone(), layer.forced_experts) for layer in module.patch.layers]
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["step"] = trainer.global_step
            seen["state"] = [(layer.bias.clone(), layer.forced_experts) for layer in pl_module.patch.layers]

    resumed = _module()
    assert resumed.patch.layers[0].forced_experts == []
    _fit(resumed, 5, tmp_path, ckpt_path=str(ckpt), callbacks=[Probe()])
    assert seen["step"] == 3
    for (bias, forced), (bias2, forced2) in zip(saved, seen["state"]):
        assert torch.equal(bias, bias2) and forced == forced2
    assert int(resumed.patch.layers[0].bias_updates) == 5


@pytest.mark.parametrize("budget,bias_mode,load", [("replace", "logit_selection", "count"),
                                                     ("append", "probability_selection", "soft"),
                                                     ("replace", "inside_softmax", "count"),
                                                     ("append_all", "inside_softmax", "soft_all_tokens")])
def test_export_reloads_with_condenser_routing_for_evaluation(tmp_path, budget, bias_mode, load):
    import transformers

    from moe_lab.methods.registry import install_exported_routing

    model = build_tiny("qwen3_moe").train()
    options = {"gamma": 0.05, "n": 1, "selection": "in_run", "selection_updates": 2, "budget": budget, "bias_mode": bias_mode, "load": load}
    patch = moe_lab.apply(model, "condenser", **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(4):  # 2 steps without condensers, then 2 with
        model(**random_batch(seed=seed)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        patch.update_biases()
    assert patch.layers[0].forced_experts
    model.eval()
    batch = random_batch()
    with torch.no_grad():
        expected = model(**batch).logits
    out = patch.export(tmp_path / "export")
    saved = json.loads((out / STATE_FILE).read_text())
    assert saved["routing"] == {"bias_mode": bias_mode, "budget": budget, "load": load}
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        plain = vanilla(**batch).logits
    reloaded = install_exported_routing(vanilla, out)
    assert reloaded.layers[0].forced_experts == patch.layers[0].forced_experts
    for a, b in zip(reloaded.layers, patch.layers):
        assert torch.equal(a.bias, b.bias) and torch.equal(a.usage, b.usage)
    with torch.no_grad():
        got = vanilla(**batch).logits
    assert torch.equal(got, expected), "the reloaded export routes and computes exactly as the trained model"
    assert not torch.allclose(plain, expected), "vanilla routing differs: the reinstall is what makes it equal"
