"""Every supported family trains under a real DeepSpeed ZeRO-3 engine (one CUDA GPU with NCCL where there is one,
else DeepSpeed's CPU accelerator with gloo), with the registry's leaf classes marked, and follows the unsharded
run it should equal.

Oracle: the same tiny model with the same method installed, trained by the same torch optimizer on the same
device without DeepSpeed. One rank holds every partition, so ZeRO-3 changes where the parameters live, not the
arithmetic: the forward gathers the same fp32 values (first loss equal), the gradient reduction over one rank
divides by 1, and the optimizer is elementwise on the flat partition. The backward may sum in another order, so
gradients agree to float32 rounding (observed <= 4e-7 absolute on O(1) gradients). The optimizer is SGD, whose
update is linear in the gradient (lr x rounding = 1e-9 a step): AdamW divides by |g| and turns the cancellation
noise of gradients that are zero in exact arithmetic (the router row of an expert no token chose, under
renormalised top-k: 1e-12 in one run, 2e-10 in the other) into updates of 0.15 x lr, which no tolerance derived
from the arithmetic can bound.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import moe_lab
from moe_lab.moe.registry import supported_families
from moe_lab.runtime.strategies import set_z3_leaf_modules
from tests.conftest import build_tiny, random_batch

pytestmark = pytest.mark.slow

DEVICE, BACKEND = ("cuda", "nccl") if torch.cuda.is_available() else ("cpu", "gloo")

STEPS, LR = 3, 1e-2


def _losses(model, step_fn, batch) -> list[float]:
    """Losses of ``STEPS`` steps; the RNG seeded first (jitter noise and sparsemixer sampling draw from it)."""
    torch.manual_seed(0)
    out = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        out.append(loss.item())
        step_fn(loss)
    return out


@pytest.mark.parametrize("family", supported_families())
def test_zero3_run_equals_the_unsharded_run(family, one_rank):
    import deepspeed

    device = torch.device(DEVICE)
    base = build_tiny(family)
    batch = {k: v.to(device) for k, v in random_batch(batch=2, seq=8).items()}

    reference = copy.deepcopy(base).to(device).train()
    moe_lab.apply(reference, "sft")
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)

    def ref_step(loss):
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

    expected = _losses(reference, ref_step, batch)

    model = copy.deepcopy(base).to(device).train()
    patch = moe_lab.apply(model, "sft")
    marked = set_z3_leaf_modules(SimpleNamespace(model=model, patch=patch))
    assert marked, f"{family}: no ZeRO-3 leaf marked"
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0})

    def z3_step(loss):
        engine.backward(loss)
        engine.step()

    try:
        got = _losses(engine, z3_step, batch)
        assert got[0] == pytest.approx(expected[0], rel=1e-6, abs=1e-6), f"{family}: first loss differs"
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-5), f"{family}: ZeRO-3 {got} vs unsharded {expected}"
        names = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                want = names[name].detach()
                torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, name=name: f"{family} {name}: {m}")
    finally:
        engine.destroy()
