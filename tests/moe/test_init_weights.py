"""A patched model initialises exactly as the vanilla one, through every transformers entry point.

transformers' ``_init_weights`` dispatches on its own module classes (``isinstance(module, HYV3MoE)`` zeroes the
block's ``e_score_correction_bias``, ``isinstance(module, Qwen3NextSparseMoeBlock)`` draws ``gate.weight``), and
``_initialize_weights`` skips modules flagged ``_is_hf_initialized``. Oracle: the vanilla model built, materialised
and initialised the same way from the same seed; every parameter and buffer is compared with ``torch.equal``.
Materialised tensors are filled with a sentinel first, so a tensor the patched model leaves alone cannot match
vanilla's by chance (``to_empty`` memory is arbitrary).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import transformers

import moe_lab
from tests.conftest import build_tiny, tiny_config

SENTINEL = 7
ENTRY_POINTS = {  # how transformers (and users) initialise a model's weights
    "init_weights": lambda model: model.init_weights(),
    "initialize_weights": lambda model: model.initialize_weights(),
    "apply_init_weights": lambda model: model.apply(model._init_weights),
}


def _on_meta(family):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(tiny_config(family))


@torch.no_grad()
def _materialised(model):
    """``model`` moved off the meta device (``to_empty``), every tensor filled with :data:`SENTINEL`."""
    model.to_empty(device="cpu")
    for tensor in (*model.parameters(), *model.buffers()):
        tensor.fill_(SENTINEL)
    return model


def _initialised(model, entry: str, seed: int = 0):
    torch.manual_seed(seed)
    ENTRY_POINTS[entry](model)
    return model


def _assert_same_tensors(model, vanilla) -> None:
    for kind in ("named_parameters", "named_buffers"):
        got, want = dict(getattr(model, kind)()), dict(getattr(vanilla, kind)())
        assert set(got) == set(want), set(got) ^ set(want)
        different = [name for name, value in got.items()
                     if value.dtype != want[name].dtype or not torch.equal(value, want[name])]
        assert not different, f"{kind}: not initialised as vanilla: {different}"


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("patched", ["on_meta", "after_to_empty"])
def test_patched_model_built_on_meta_initialises_as_vanilla(family, patched, entry):
    """Built on the meta device, patched (before or after ``to_empty``), initialised: vanilla's tensors."""
    vanilla = _initialised(_materialised(_on_meta(family)), entry)
    model = _on_meta(family)
    if patched == "on_meta":
        moe_lab.apply(model, "sft")
    _materialised(model)
    if patched == "after_to_empty":
        moe_lab.apply(model, "sft")
    _assert_same_tensors(_initialised(model, entry), vanilla)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_reinitialising_a_patched_model_does_what_vanilla_does(family, entry):
    """An initialised model patched, then initialised again: vanilla skips the modules it already initialised
    (``init_weights``, ``initialize_weights``) or redraws every one (``apply(_init_weights)``), so does the patched
    one."""
    vanilla = _initialised(build_tiny(family), entry, seed=1)
    model = build_tiny(family)
    moe_lab.apply(model, "sft")
    _assert_same_tensors(_initialised(model, entry, seed=1), vanilla)


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model))],
                         ids=["deepcopy", "pickle"])
def test_copied_patched_model_initialises_as_vanilla(family, clone):
    """A patched model deep-copied or pickled (ddp_spawn) before its initialisation initialises as vanilla."""
    vanilla = _initialised(_materialised(_on_meta(family)), "init_weights")
    model = _on_meta(family)
    moe_lab.apply(model, "sft")
    model = clone(_materialised(model))
    _assert_same_tensors(_initialised(model, "init_weights"), vanilla)


def test_removed_patch_leaves_vanilla_initialisation(family):
    """After ``remove()`` the vanilla block is back in the model with the tensors initialised while patched, and
    the model's own ``_init_weights`` is the class's again."""
    vanilla = _initialised(_materialised(_on_meta(family)), "init_weights")
    model = _materialised(_on_meta(family))
    patch = moe_lab.apply(model, "sft")
    _initialised(model, "init_weights")
    patch.remove()
    assert all("_init_weights" not in vars(m) for m in model.modules())
    _assert_same_tensors(model, vanilla)
