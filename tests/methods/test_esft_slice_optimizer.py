"""slice_optimizer: an optimizer that steps only ESFT's trained expert slices gives bit-identical parameters
to the same optimizer stepping the whole packed tensors (the oracle: torch's own step on full tensors, frozen
slices kept by zero gradients / FrozenSliceGuard), in a plain loop with gradient accumulation and in Lightning
with accumulation and clipping."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import moe_lab
from moe_lab.methods import esft_module
from moe_lab.methods.esft import slice_optimizer
from moe_lab.methods.esft_module import ESFTLightningModule, partitioned
from tests.conftest import build_tiny, random_batch

EXPERTS = {0: [1, 2, 6], 1: [3]}  # layer 0: runs [1, 3) and [6, 7); layer 1: [3, 4)
OPTIMIZERS = {
    "adamw_default_wd": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "sgd_momentum_wd": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9, weight_decay=0.1),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sliced_step_is_bit_identical_to_the_full_step(name):
    model = build_tiny("olmoe").train()
    patch = moe_lab.apply(model, "esft", experts=EXPERTS)
    oracle = build_tiny("olmoe").train()
    moe_lab.apply(oracle, "esft", experts=EXPERTS)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sliced = OPTIMIZERS[name](model.parameters())
    full = OPTIMIZERS[name](oracle.parameters())
    assert slice_optimizer(sliced, patch) == 4  # gate_up_proj and down_proj of the two MoE layers
    n_sliced = sum(p.numel() for g in sliced.param_groups for p in g["params"])
    n_full = sum(p.numel() for g in full.param_groups for p in g["params"])
    experts = model.model.layers[0].mlp.experts
    per_expert = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
    assert n_full - n_sliced == per_expert * ((8 - 3) + (8 - 1))  # the frozen slices left the optimizer
    for step in range(3):
        for m, opt in ((model, sliced), (oracle, full)):
            for micro in range(2):  # gradient accumulation over two micro-batches
                m(**random_batch(seed=10 * step + micro)).loss.backward()
            opt.step()
            opt.zero_grad()
    oracle_params = dict(oracle.named_parameters())
    for pname, param in model.named_parameters():
        assert torch.equal(param, oracle_params[pname]), pname
        assert param.grad is None, pname
    down = model.model.layers[0].mlp.experts.down_proj
    start = before["model.layers.0.mlp.experts.down_proj"]
    assert [not torch.equal(down[e], start[e]) for e in range(8)] == [e in EXPERTS[0] for e in range(8)]


def test_non_elementwise_optimizers_and_stepped_tensors_are_left_alone():
    model = build_tiny("olmoe").train()
    patch = moe_lab.apply(model, "esft", experts=EXPERTS)
    asgd = torch.optim.ASGD(model.parameters(), lr=1e-2)
    assert slice_optimizer(asgd, patch) == 0
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**random_batch()).loss.backward()
    adamw.step()  # every tensor now has state: slicing would lose it
    assert slice_optimizer(adamw, patch) == 0


def test_new_storage_after_slicing_is_refused():
    model = build_tiny("olmoe").train()
    patch = moe_lab.apply(model, "esft", experts=EXPERTS)
    slice_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), patch)
    model.half().float()  # a round trip: float32 again, in new storage
    batch = random_batch()
    with pytest.raises(RuntimeError, match="build the optimizer after"):
        model(**batch).loss.backward()


def _fit(tmp_path, monkeypatch, sliced: bool, clip: float | None):
    torch.manual_seed(0)
    module = ESFTLightningModule(build_tiny("olmoe"), options={"experts": EXPERTS},
                                 optim={"lr": 1e-2, "weight_decay": 0.1})
    trainer = L.Trainer(max_steps=2, accumulate_grad_batches=2, gradient_clip_val=clip, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", default_root_dir=tmp_path)
    with monkeypatch.context() as m:
        if not sliced:
            m.setattr(esft_module, "slice_optimizer", lambda optimizer, patch: 0)
        batches = [random_batch(batch=4, seq=12, seed=s) for s in range(4)]
        trainer.fit(module, DataLoader(batches, batch_size=None))
    n = sum(p.numel() for g in trainer.optimizers[0].param_groups for p in g["params"])
    return {k: v.detach() for k, v in module.model.named_parameters()}, n


def test_lightning_module_slices_and_matches_the_unsliced_optimizer(tmp_path, monkeypatch):
    sliced, n_sliced = _fit(tmp_path, monkeypatch, True, None)
    full, n_full = _fit(tmp_path, monkeypatch, False, None)
    assert n_sliced < n_full
    for name, param in sliced.items():
        assert torch.equal(param, full[name]), name


def test_lightning_clipping_differs_only_by_the_norm_rounding(tmp_path, monkeypatch):
    """Clipping sums the gradient norm per trained run instead of per packed tensor (the frozen zeros add
    nothing): the clip coefficient may differ by the rounding of that sum, relative <= n x eps over n
    gradient entries. Adam's update m / sqrt(v) changes by at most that relative amount (|m / sqrt(v)| <= 1
    here: one-sided bound per step), so each of the 2 steps moves a trained entry by <= lr x n x eps more,
    plus the rounding of the weight-decayed value (<= 2 eps |p| per step). Frozen slices stay exact."""
    sliced, _ = _fit(tmp_path, monkeypatch, True, 0.05)
    full, _ = _fit(tmp_path, monkeypatch, False, 0.05)
    eps, n = torch.finfo(torch.float32).eps, sum(p.numel() for p in full.values())
    for name, param in sliced.items():
        if ".experts." not in name:
            assert torch.equal(param, full[name]), name
            continue
        layer = int(name.split(".")[2])
        for e in range(param.shape[0]):
            if e not in EXPERTS[layer]:
                assert torch.equal(param[e], full[name][e]), f"{name}[{e}]"
        bound = 2 * (1e-2 * n * eps + 2 * eps * float(full[name].abs().max()))
        assert float((param - full[name]).abs().max()) <= bound, name


def test_a_checkpoint_with_packed_optimizer_state_is_refused_by_name(tmp_path):
    """A checkpoint written before the optimizer was sliced (no optimizer_layout: whole packed tensors) cannot
    restore into the sliced optimizer: refused with the way out, not torch's group-size error. A checkpoint of
    this version round-trips."""
    def module():
        return ESFTLightningModule(build_tiny("olmoe"), options={"experts": EXPERTS}, optim={"lr": 1e-2})

    writer = module()
    writer.configure_optimizers()
    saved = {"optimizer_states": [{}]}
    writer.on_save_checkpoint(saved)
    assert saved["moe_lab_esft"]["optimizer_layout"] == "sliced"
    reader = module()
    reader.on_load_checkpoint(saved)
    reader.configure_optimizers()  # same layout: accepted
    old = {"optimizer_states": [{}], "moe_lab_esft": {k: v for k, v in saved["moe_lab_esft"].items()
                                                      if k != "optimizer_layout"}}
    reader = module()
    reader.on_load_checkpoint(old)
    with pytest.raises(ValueError, match="optimizer state for packed expert tensors, but this run steps sliced"):
        reader.configure_optimizers()


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_flat_sharding_strategies_neither_score_nor_slice(strategy):
    """FSDP and DeepSpeed step flat parameters: ESFT keeps the packed optimizer. It scores on whole weights (Lightning
    calls ``setup`` before the strategy wraps the model) and refuses once they are shards (a ZeRO-3 partition
    carries ``ds_id``: tests/methods/test_slice_decay.py checks it on DeepSpeed's engine)."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    module = ESFTLightningModule(build_tiny("olmoe"), options={"experts": EXPERTS}, optim={"lr": 1e-2})
    module._trainer = SimpleNamespace(strategy=FSDPStrategy() if strategy == "fsdp" else DeepSpeedStrategy(stage=2),
                                      estimated_stepping_batches=10)
    assert not partitioned(module.model)
    next(module.model.parameters()).ds_id = 0  # what deepspeed.zero.Init / the ZeRO-3 engine sets on a partition
    with pytest.raises(ValueError, match="ESFT cannot score the training data under .* already sharded"):
        module._score_training_data()
    module.configure_optimizers()
    assert module.optimizer_layout == "packed"
