"""The registry's ZeRO-3 leaf class (``FamilySpec.block_class``) of every supported family is the module that
holds the experts and runs them and the router, and DeepSpeed's leaf configuration accepts it (config level: no
engine runs on CPU).

Oracle: one forward pass of the tiny model with hooks, no moe-lab view code. The module DeepSpeed must treat as a
leaf is the innermost module whose forward runs the data-dependent expert computation: it holds ``experts`` as a
child, and every call of those experts and of the router (the module holding the [E, H] routing weight inside it)
happens inside its own forward.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moe_lab
from moe_lab.moe.block import MoEBlock
from moe_lab.moe.registry import family_spec, supported_families
from moe_lab.runtime.strategies import set_z3_leaf_modules, z3_leaf_classes
from tests.conftest import build_tiny, random_batch


def _holders(model) -> list[torch.nn.Module]:
    """The modules holding an ``experts`` child, in model order."""
    return [m for m in model.modules() if "experts" in m._modules]


def _router(holder, hidden: int) -> torch.nn.Module:
    """The module (outside the experts) owning a [num_experts, hidden] weight under ``holder``: the router."""
    experts = set(holder.experts.modules())
    # packed [E, ...] expert tensors; DBRX's [E*I, H] rows: its experts module's own num_experts
    num_experts = getattr(holder.experts, "num_experts", None) or next(holder.experts.parameters()).shape[0]
    owners = [m for m in holder.modules() if m not in experts
              and any(p.shape == (num_experts, hidden) for p in m.parameters(recurse=False))]
    assert len(owners) == 1, f"{type(holder).__name__}: expected one router weight, found {len(owners)}"
    return owners[0]


def _calls_inside(model, holders, routers) -> None:
    """Run one forward; assert every experts / router call happens inside its own holder's forward."""
    active: list[torch.nn.Module] = []
    calls = {id(m): 0 for m in [*routers, *(h.experts for h in holders)]}
    owner = {id(r): h for h, r in zip(holders, routers)} | {id(h.experts): h for h in holders}
    handles = []
    for holder in holders:
        handles.append(holder.register_forward_pre_hook(lambda m, a: active.append(m)))
        handles.append(holder.register_forward_hook(lambda m, a, o: active.remove(m)))
    for module in [*routers, *(h.experts for h in holders)]:
        def seen(m, args):
            assert active and active[-1] is owner[id(m)], f"{type(m).__name__} runs outside its MoE block"
            calls[id(m)] += 1
        handles.append(module.register_forward_pre_hook(seen))
    try:
        with torch.no_grad():
            model(**random_batch(batch=2, seq=6))
    finally:
        for handle in handles:
            handle.remove()
    assert all(calls.values()), "every MoE block ran its router and its experts"


@pytest.mark.parametrize("family", supported_families())
def test_registry_leaf_class_holds_the_experts_and_is_accepted(family):
    from deepspeed.utils import get_z3_leaf_modules
    from deepspeed.utils import set_z3_leaf_modules as deepspeed_mark
    from deepspeed.utils.z3_leaf_module import z3_leaf_module

    model = build_tiny(family).eval()
    spec = family_spec(family)
    holders = _holders(model)
    assert holders, f"{family}: no module holds experts"
    routers = [_router(h, model.config.hidden_size) for h in holders]
    assert {type(h).__name__ for h in holders} == {spec.block_class}, (
        f"{family}: registry block_class={spec.block_class!r}, the experts are held by "
        f"{sorted({type(h).__name__ for h in holders})}")
    # innermost: the experts and the router sit in different children of the leaf (no child could be it)
    for holder, router in zip(holders, routers):
        assert router is not holder and not any(router in set(c.modules()) and holder.experts in set(c.modules())
                                                for c in holder.children())
    _calls_inside(model, holders, routers)

    # config level: the class moe-lab resolves is the holders' class; DeepSpeed marks exactly the holders
    leaf_class = z3_leaf_classes(model)[0]
    assert all(type(h) is leaf_class for h in holders)
    assert deepspeed_mark(model, [leaf_class]) == holders
    assert get_z3_leaf_modules(model) == holders
    # with a method installed: moe-lab's MoEBlocks replace the holders in the tree and are marked, and the HF
    # blocks the patch holds aside (back on export) stay marked
    patch = moe_lab.apply(model, "sft")
    marked = set_z3_leaf_modules(SimpleNamespace(model=model, patch=patch))
    assert marked == list(patch.layers) and all(isinstance(m, MoEBlock) for m in marked)
    assert [view.block for view in patch.views] == holders
    assert all(z3_leaf_module(view.block) for view in patch.views)
