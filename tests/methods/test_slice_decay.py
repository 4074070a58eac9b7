"""The trained expert slices' weight decay (moe_lab.methods.slice_decay): AdamW's own decay on exactly the trained
slices, whether a torch optimizer steps the tensors or a DeepSpeed ZeRO optimizer steps fp32 master partitions.

Oracles: torch's ``AdamW(weight_decay=wd)`` on the whole tensor (the trained slices must move bit for bit as it
moves them); an element mask built by hand for the partition arithmetic; the unsharded ESFT run for DeepSpeed's
CPU engine (ZeRO-2 and ZeRO-3, one rank over gloo, the tests/runtime/test_z3_families.py setting: the same fp32
values, the backward summed in another order, so losses and weights agree to float32 rounding amplified by Adam,
while the frozen slices never move at all).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from moe_lab.methods.base import MoELightningModule
from moe_lab.methods.esft_module import partitioned
from moe_lab.methods.slice_decay import ZeroSlicedWeightDecay, decay_runs, sliced_weight_decay, trained_runs
from moe_lab.moe import find_moe_layers
from tests.conftest import build_tiny, random_batch

WD = 0.1


def test_trained_runs_and_partition_offsets_decay_exactly_the_masked_elements():
    mask = torch.tensor([True, True, False, True, False, False, True])
    assert trained_runs(mask) == [(0, 2), (3, 4), (6, 7)]
    shape = (7, 3, 5)
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(shape, generator=gen)
    expected = value.clone()
    expected[mask] *= 0.75  # by hand: whole rows of the trained experts
    for pieces in (1, 2, 3, 4, 8):  # ZeRO partitions: even splits of the flattened tensor, rows cut anywhere
        got = value.clone().view(-1)
        size = -(-got.numel() // pieces)
        for start in range(0, got.numel(), size):
            decay_runs(got[start:start + size], start, 15, trained_runs(mask), 0.75)
        assert torch.equal(got.view(shape), expected), pieces


def test_sliced_decay_moves_the_trained_slices_exactly_as_adamw_and_the_frozen_ones_not_at_all():
    gen = torch.Generator().manual_seed(1)
    initial = torch.randn(6, 4, 3, generator=gen)
    mask = torch.tensor([False, True, True, False, True, False])
    sliced, whole = torch.nn.Parameter(initial.clone()), torch.nn.Parameter(initial.clone())
    opt = torch.optim.AdamW([{"params": [sliced], "weight_decay": 0.0}], lr=0.05)
    sliced_weight_decay(opt, [(sliced, mask)], WD)
    ref = torch.optim.AdamW([whole], lr=0.05, weight_decay=WD)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: (t + 1) / 4) for o in (opt, ref)]
    for _ in range(5):
        grad = torch.randn(initial.shape, generator=gen) * mask.view(-1, 1, 1)  # the slice hooks' zeros
        sliced.grad, whole.grad = grad.clone(), grad.clone()
        opt.step(), ref.step()
        for s in schedules:
            s.step()
    assert torch.equal(sliced[mask], whole[mask])
    assert torch.equal(sliced[~mask], initial[~mask]) and not torch.equal(whole[~mask], initial[~mask])


def _esft(model, kind: str | None):
    """moe-lab's ESFT module and its optimizer as a run under ``kind`` builds them (warm-up schedule, wd)."""
    layers = [v.index for v in find_moe_layers(model)]
    module = MoELightningModule(model, "esft", options={"experts": {layers[0]: [1, 6], layers[1]: [3]}},
                                optim={"lr": 1e-2, "weight_decay": WD},
                                scheduler={"name": "linear", "warmup_steps": 2})
    from tests.runtime.test_strategies import _strategy

    strategy = SimpleNamespace() if kind is None else _strategy(kind)[1]  # None: one device, torch's optimizer
    module._trainer = SimpleNamespace(strategy=strategy, estimated_stepping_batches=8)
    config = module.configure_optimizers()
    return module, config["optimizer"], config["lr_scheduler"]["scheduler"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_esft_with_weight_decay_under_zero_equals_the_unsharded_run(stage, one_rank):
    import deepspeed

    base = build_tiny("olmoe")
    batches = [random_batch(batch=4, seq=16, seed=s) for s in range(4)]

    module, opt, sched = _esft(copy.deepcopy(base).train(), None)
    expected = []
    for batch in batches:
        loss = module.model(**batch).loss
        expected.append(loss.item())
        loss.backward()
        # every trained expert got tokens: torch skips a tensor whose gradient is None, where ZeRO steps a zero
        # gradient (Adam's momentum then moves it); an engine difference, not the decay's
        assert all(p.grad is not None for p in module.model.parameters() if p.requires_grad)
        opt.step(), sched.step(), opt.zero_grad()
    reference = dict(module.model.named_parameters())

    module, opt, sched = _esft(copy.deepcopy(base).train(), f"deepspeed_zero{stage}")
    assert isinstance(module.zero_slice_decay, ZeroSlicedWeightDecay)
    assert not partitioned(module.model)  # Lightning scores the selection in setup, before the engine wraps
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    engine, *_ = deepspeed.initialize(model=module.model, optimizer=opt, lr_scheduler=sched, config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0})
    assert partitioned(module.model) == (stage == 3)
    try:
        got = []
        for batch in batches:
            loss = engine(**batch).loss
            got.append(loss.item())
            engine.backward(loss)
            module.zero_slice_decay.before_step()
            engine.step()
        assert got[0] == pytest.approx(expected[0], rel=1e-6, abs=1e-6)
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-5), (got, expected)
        masks = {id(p): m for p, m in module.patch.expert_slice_masks.values()}
        for name, p in module.model.named_parameters():
            with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
                value = p.detach().clone()
            torch.testing.assert_close(value, reference[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"ZeRO-{stage} {name}: {m}")
            if id(p) in masks:  # frozen slices never move; trained ones did (decay included)
                mask = masks[id(p)]
                assert torch.equal(value[~mask], initial[name][~mask]), name
                assert not torch.equal(value[mask], initial[name][mask]), name
            elif not p.requires_grad:
                assert torch.equal(value, initial[name]), name
    finally:
        engine.destroy()


@pytest.mark.slow
def test_without_the_master_decay_zero_would_not_decay_the_trained_slices(one_rank):
    """The oracle above can fail: the same ZeRO-2 run without ``before_step`` ends off the unsharded run (the
    torch hooks decay nothing under ZeRO: its optimizer steps flat fp32 partitions)."""
    import deepspeed

    base = build_tiny("olmoe")
    batch = random_batch(batch=2, seq=8)
    runs = []
    for decay in (True, False):
        module, opt, sched = _esft(copy.deepcopy(base).train(), "deepspeed_zero2")
        engine, *_ = deepspeed.initialize(model=module.model, optimizer=opt, lr_scheduler=sched, config={
            "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0})
        try:
            for _ in range(3):
                engine.backward(engine(**batch).loss)
                if decay:
                    module.zero_slice_decay.before_step()
                engine.step()
            runs.append({n: p.detach().clone() for n, p in module.model.named_parameters()})
        finally:
            engine.destroy()
    sliced = [name for name, p in runs[0].items() if "experts" in name and not torch.equal(p, runs[1][name])]
    assert sliced, "the decay changed nothing"
