"""Under bf16 autocast with fp32 master weights, moe-lab runs the packed experts in bf16.

HF's grouped / batched expert matmuls are not autocast-enabled: vanilla HF casts the activations up to the fp32
weights and computes every expert in fp32. moe-lab casts the packed 3-D expert tensors to the autocast dtype
instead (as autocast does for every ``F.linear`` weight). Oracle: vanilla HF run with exactly those casts done
by hand (``torch.func.functional_call`` with bf16 copies of the expert tensors), which must give the same
logits and the same fp32 gradients bit for bit; and the plain vanilla forward (fp32 experts) must differ.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moe_lab
from tests.conftest import FAMILIES, build_tiny, random_batch


def _packed_expert_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3]


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_run_in_autocast_dtype_with_fp32_gradients(family):
    vanilla = build_tiny(family).train()
    ours = copy.deepcopy(vanilla)
    moe_lab.apply(ours, "sft")
    batch = random_batch()
    names = _packed_expert_names(vanilla)
    assert names, "the tiny model has packed experts"

    torch.manual_seed(7)  # phimoe samples its routing in training
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ours(**batch)
    got.loss.backward()

    params = dict(vanilla.named_parameters())
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.func.functional_call(vanilla, {n: params[n].to(torch.bfloat16) for n in names}, kwargs=batch)
    ref.loss.backward()
    assert torch.equal(got.logits, ref.logits), (got.logits - ref.logits).abs().max()
    for name, p in ours.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, params[name].grad), name

    with torch.no_grad():
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fp32_experts = vanilla(**batch).logits
    assert not torch.equal(got.logits, fp32_experts), "the experts ran in fp32 (not cast to bf16)"


def test_no_cast_without_autocast_or_for_bf16_weights():
    from moe_lab.moe.block import autocast_expert_weights

    model = build_tiny("olmoe")
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    assert autocast_expert_weights(experts, "cpu") == {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = autocast_expert_weights(experts, "cpu")
        assert sorted(cast) == ["down_proj", "gate_up_proj"]
        assert all(t.dtype == torch.bfloat16 for t in cast.values())
        experts.to(torch.bfloat16)
        assert autocast_expert_weights(experts, "cpu") == {}
