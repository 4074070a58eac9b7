"""An export carries the model's own config, not the training-time aux-loss switch."""

from __future__ import annotations

import json

import torch
import transformers

from moe_lab import apply
from tests.conftest import build_tiny


def test_native_aux_loss_export_keeps_output_router_logits_off_and_generates(tmp_path):
    model = build_tiny("olmoe")
    assert not model.config.output_router_logits
    patch = apply(model, "sft")
    assert patch.set_aux_loss_coef(0.01)  # the native OLMoE loss, as method=sft trains it
    assert model.config.output_router_logits
    patch.export(tmp_path / "export")
    assert model.config.output_router_logits  # training keeps its switch after the export
    saved = json.loads((tmp_path / "export" / "config.json").read_text())
    assert saved["output_router_logits"] is False
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    out = reloaded.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 7)
