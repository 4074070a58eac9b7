"""DenseMixer's cost in dispatched ops (issue 28: "DenseMixer at its FLOP floor"): the inactive experts run as a few
grouped kernels per layer, not a Python loop over the experts with a host sync per expert."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_lab
from tests.conftest import build_tiny

# ops whose result the host must wait for (a data-dependent output shape, or a value read back)
HOST_SYNCING = {"nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                "unique_consecutive", "bincount", "repeat_interleave", "equal", "is_nonzero", "allclose"}


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, by name; a bool-mask index counts as a ``nonzero``."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        self.ops[name] += 1
        if name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.ops["nonzero"] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(base, method: str, **options) -> collections.Counter:
    model = copy.deepcopy(base)
    moe_lab.apply(model, method, **options)
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with OpCounter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.ops


@pytest.mark.parametrize("options", [{}, {"forward": "dense", "gradient": "conventional"}], ids=["ste", "ablation"])
def test_densemixer_dispatches_few_ops_and_no_host_sync_per_expert(options):
    """One forward + backward of a tiny OLMoE with 64 experts, top-8 (2 MoE layers, every token in one chunk):
    DenseMixer (straight-through, and the dense-forward ablation) dispatches at most 2.5 x sft's ops, and at most
    2 host-syncing ops per MoE layer (the per-expert loop it replaces dispatched 4.6 x sft's ops, with a nonzero
    per expert and layer)."""
    base = build_tiny("olmoe", num_experts=64, num_experts_per_tok=8).train()
    layers = base.config.num_hidden_layers
    sft, dm = _step_ops(base, "sft"), _step_ops(base, "densemixer", **options)
    assert sum(sft.values()) > 100, sft  # the counter sees the model's ops
    syncs = {name: n for name, n in dm.items() if name in HOST_SYNCING}
    assert sum(syncs.values()) <= 2 * layers, syncs
    ratio = sum(dm.values()) / sum(sft.values())
    assert ratio <= 2.5, (ratio, (dm - sft).most_common(10))


class MatmulDtypes(TorchDispatchMode):
    """Counts matrix products by (op, operand dtypes)."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm"):
            operands = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
            self.seen[(name, *(str(a.dtype).removeprefix("torch.") for a in operands))] += 1
        return func(*args, **(kwargs or {}))


def test_inactive_experts_run_in_the_autocast_dtype():
    """Under bf16 autocast with fp32 master weights the block runs the experts in bf16 (moe.block casts the expert
    tensors); the backward's inactive-expert pass must too (autocast is off in a backward pass: without the cast
    it ran fp32 GEMMs, E - k of them per token, beside sft's bf16 ones). Every matmul DenseMixer's backward adds
    to sft's is a bf16 grouped matmul."""
    base = build_tiny("olmoe").train()
    ids = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    seen = {}
    for method in ("sft", "densemixer"):
        model = copy.deepcopy(base)
        moe_lab.apply(model, method)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        with MatmulDtypes() as counter:
            loss.backward()
        seen[method] = counter.seen
    extra = seen["densemixer"] - seen["sft"]
    assert extra and set(extra) == {("_grouped_mm", "bfloat16", "bfloat16")}, extra
    assert not seen["sft"] - seen["densemixer"]
