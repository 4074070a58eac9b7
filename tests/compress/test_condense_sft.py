"""Lightweight SFT after CD-MoE (spec 3.8): only the condensed layers' retained experts change."""

from __future__ import annotations

import torch

from moe_lab.compress import calibrate, condense, export_condensed, load_condensed
from moe_lab.methods.condense_sft import CondenseSFTModule
from tests.conftest import build_tiny, random_batch


def test_condense_sft_trains_only_retained_experts(tmp_path):
    model = build_tiny("deepseek_v2").eval()
    cal = calibrate(model, [random_batch(3, 10)])
    export_condensed(condense(model, cal, [1], {1: [2, 0]}), tmp_path / "cd")
    module = CondenseSFTModule(build_tiny("deepseek_v2"), options={"condensed": str(tmp_path / "cd")},
                               optim={"lr": 1e-2})
    before = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    assert sorted(module.trainable_names) == sorted(
        f"model.layers.1.mlp.{n}" for n in ("gate_up_proj", "down_proj", "shared_experts.gate_proj.weight",
                                             "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"))
    opt = module.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt[0][0] if isinstance(opt, tuple) else opt
    module.train()
    for step in range(3):
        batch = random_batch(2, 8, seed=step)
        module.model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    after = module.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == set(module.trainable_names)
    module.patch.export(tmp_path / "sft", tokenizer=None)
    back = load_condensed(tmp_path / "sft")
    batch = random_batch(2, 8, seed=9)
    module.eval()
    with torch.no_grad():
        assert torch.equal(back(**batch).logits, module.model(**batch).logits)
