"""Every method trains every family where it applies: 20 Lightning steps with falling loss."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import moe_lab
from moe_lab.methods.base import MoELightningModule
from moe_lab.methods.registry import undefined_reason
from moe_lab.moe import find_moe_layers
from tests.conftest import FAMILY_PARAMS, build_tiny, random_batch


def _undefined(method: str, model) -> str | None:
    """Why ``method`` is not defined for the family of ``model`` (moe_lab.moe.support), or None."""
    view = find_moe_layers(model)[0]
    return undefined_reason(method, view.spec, view.rule)


# ESFT trains 3 experts' slices only (attention, router, embeddings frozen): the one-MoE-layer tiny configs of the
# added families need a larger step to lower the loss by 20% in 20 steps
LR = {"esft": 3e-2}


def _options(method: str, model) -> dict:
    patch = moe_lab.apply(model, "sft")
    layers, num_experts = [layer.index for layer in patch.layers], patch.layers[0].num_experts
    if method == "condenser":
        return {"gamma": 1e-2, "n": 1, "selection": "in_run", "selection_updates": 5}
    if method == "esft":
        return {"experts": {i: list(range(num_experts - 1)) for i in layers}}  # one expert stays frozen
    return {}


def _methods() -> list[tuple[str, float | str]]:
    """(method, aux_loss_coef) for every registered method, plus sft with the family's native aux loss."""
    return [(m, 0.0) for m in moe_lab.supported_methods()] + [("sft", "native")]


@pytest.mark.parametrize("family", FAMILY_PARAMS)
@pytest.mark.parametrize("method,aux", _methods(), ids=lambda v: str(v))
def test_twenty_steps_lower_the_loss(method, aux, family):
    name, model = method, build_tiny(family)
    options = _options(name, copy.deepcopy(model))  # sft is applied to the copy to read the layout
    if _undefined(name, model):  # refused by name
        with pytest.raises(ValueError, match=f"{name} is not defined for {family}: "):
            moe_lab.apply(model, name, **options)
        return
    torch.manual_seed(0)
    module = MoELightningModule(model, method=name, options=options, aux_loss_coef=aux,
                                optim={"lr": LR.get(name, 3e-3), "weight_decay": 0.01})
    batches = [random_batch(batch=4, seq=16, seed=s) for s in range(2)]
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(max_steps=20, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Record()], accelerator="cpu")
    trainer.fit(module, DataLoader(batches * 10, batch_size=None))
    assert len(losses) == 20
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.8 * first, f"{method}/{family}: loss {first:.3f} -> {last:.3f}"
    if name == "condenser":
        assert all(len(layer.forced_experts) == 1 for layer in module.patch.layers)
        assert int(module.patch.layers[0].bias_updates) == 20
