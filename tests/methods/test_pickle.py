"""Patched models pickle (dynamic router classes, hooks, method state), so ddp_spawn and torch.save work."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import moe_lab
from tests.conftest import build_tiny, random_batch


def _layers(model):
    return [layer.index for layer in moe_lab.apply(copy.deepcopy(model)).layers]


CASES = [
    ("olmoe", "sft", {}),
    ("qwen3_moe", "condenser", {"n": 1, "selection": "in_run", "selection_updates": 1, "gamma": 0.1}),
    ("gpt_oss", "densemixer", {}),
    ("qwen2_moe", "compressed_experts", {}),
    ("deepseek_v3", "esft", "experts"),
    ("mixtral", "sft", {"lora": {"rank": 2, "targets": ["attention"]}}),
]


def test_lora_on_packed_experts_does_not_pickle_use_ddp_not_ddp_spawn():
    """torch parametrizations refuse pickling; LoRA on packed experts therefore needs strategy=ddp."""
    model = build_tiny("olmoe")
    moe_lab.apply(model, "sft", lora={"rank": 2, "targets": ["experts"]})
    with pytest.raises(RuntimeError, match="parametrized"):
        pickle.dumps(model)


@pytest.mark.parametrize("family,method,options", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_pickle_round_trip_keeps_outputs_gradients_and_method_state(family, method, options):
    model = build_tiny(family).train()
    if options == "experts":
        options = {"experts": {i: [0, 3] for i in _layers(model)}}
    patch = moe_lab.apply(model, method, **options)
    batch = random_batch()
    model(**batch)
    if method == "condenser":
        patch.update_biases()
        assert patch.layers[0].forced_experts
    clone = pickle.loads(pickle.dumps(model))
    for m in (model, clone):
        torch.manual_seed(0)
        m.zero_grad()
        m(**batch).loss.backward()
    torch.manual_seed(0)
    assert torch.equal(model(**batch).logits, clone(**batch).logits)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in clone.named_parameters():
        assert (p.grad is None) == (grads[n] is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, grads[n]), n


@pytest.mark.slow
def test_ddp_spawn_trains_condenser_on_two_cpu_processes():
    import lightning as L
    from torch.utils.data import DataLoader

    from moe_lab.methods.base import MoELightningModule

    module = MoELightningModule(build_tiny("olmoe"), method="condenser",
                                options={"n": 1, "selection": "in_run", "selection_updates": 2, "gamma": 1e-2})
    batches = [random_batch(batch=2, seq=8, seed=s) for s in range(8)]
    trainer = L.Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(batches, batch_size=None))
    # rank 0's weights and buffers come back to this process
    assert int(module.patch.layers[0].bias_updates) == 3
    assert len(module.patch.layers[0].forced_experts) == 1
