"""DenseMixer under sharded parameters: DeepSpeed ZeRO-3 (its CPU engine) and torch FSDP (one unit per decoder layer,
as moe-lab's FSDP strategy wraps), two ranks over gloo, each on half of the global batch.

DenseMixer's backward runs every inactive expert on the packed expert weights (``_InactiveExperts``). ZeRO-3
gathers a leaf module's parameters again for its backward (moe-lab marks the MoE blocks as leaves) and FSDP
unshards a unit before its backward, so that pass runs inside the gathered scope: the sharded run must equal the
single-process run of the same global batch (mean of the two halves' losses, what data parallelism averages).
Tolerance from the arithmetic: the ranks' gradients are averaged as g1/2 + g2/2 where the reference sums
(g1 + g2)/2 (halving is exact in binary floats, so only ZeRO's bucketed reduction order remains), and SGD
(update linear in the gradient) keeps float32 rounding from being amplified as Adam would; first loss to 1e-6,
every gathered parameter to 1e-6.
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch

import moe_lab
from tests.conftest import build_tiny, random_batch, run_ranks

pytestmark = pytest.mark.slow

WORLD, BATCH, STEPS, LR = 2, 4, 3, 1e-2


def _batch():
    return random_batch(batch=BATCH, seq=8, pad_rows=((1, 3),))


def _half(batch: dict, rank: int) -> dict:
    n = BATCH // WORLD
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def _sharded_run(rank: int, port: int, family: str, method: str, engine: str, out: str) -> None:
    """One rank: the tiny model with ``method``, sharded by ``engine``, trained STEPS SGD steps on its half."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model = build_tiny(family).train()
    patch = moe_lab.apply(model, method)
    mine, losses = _half(_batch(), rank), []
    if engine == "deepspeed_zero3":
        import deepspeed

        from moe_lab.runtime.strategies import set_z3_leaf_modules

        deepspeed.init_distributed(dist_backend="gloo")
        set_z3_leaf_modules(SimpleNamespace(model=model, patch=patch))
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        wrapped, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
            "train_micro_batch_size_per_gpu": BATCH // WORLD, "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0})
        for _ in range(STEPS):
            loss = wrapped(**mine).loss
            losses.append(loss.item())
            wrapped.backward(loss)
            wrapped.step()
        params = {}
        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                params[name] = p.detach().clone()
    else:
        import torch.distributed as dist
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        layers = {type(m) for m in model.modules() if type(m).__name__ in set(model._no_split_modules or ())}
        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(layers), device_id=torch.device("cpu"),
                       use_orig_params=True)
        opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=LR)
        for _ in range(STEPS):
            loss = wrapped(**mine).loss
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        with FSDP.summon_full_params(wrapped, writeback=False):
            params = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in wrapped.named_parameters()}
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("family,engine", [("olmoe", "deepspeed_zero3"), ("qwen3_moe", "deepspeed_zero3"),
                                           ("olmoe", "fsdp")])
def test_densemixer_sharded_equals_the_single_process_run(family, engine, tmp_path):
    base = build_tiny(family).train()
    reference = copy.deepcopy(base)
    moe_lab.apply(reference, "densemixer")
    opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)
    batch, first = _batch(), None
    for _ in range(STEPS):
        halves = [reference(**_half(batch, r)).loss for r in range(WORLD)]
        first = halves[0].item() if first is None else first
        (sum(halves) / WORLD).backward()
        opt.step()
        opt.zero_grad()

    out = tmp_path / "rank0.pt"
    run_ranks(_sharded_run, WORLD, family, "densemixer", engine, str(out))
    got = torch.load(out)
    assert got["losses"][0] == pytest.approx(first, rel=1e-6, abs=1e-6)  # rank 0's half, before any step
    expected = dict(reference.named_parameters())
    assert set(got["params"]) == set(expected)
    moved = 0
    for name, value in got["params"].items():
        torch.testing.assert_close(value, expected[name].detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{engine} {family} {name}: {m}")
        moved += not torch.equal(value, dict(base.named_parameters())[name])
    assert moved == len(expected)  # every parameter trained (the router through every expert's output)
