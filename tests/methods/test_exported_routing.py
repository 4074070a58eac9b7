"""install_exported_routing: an export's method files bring its routing back onto the vanilla model."""

from __future__ import annotations

import torch
import transformers

import moe_lab
from moe_lab.methods.registry import install_exported_routing
from tests.conftest import build_tiny, random_batch


def test_compressed_experts_export_reinstalls_its_vectors(tmp_path):
    model = build_tiny("qwen2_moe").eval()
    patch = moe_lab.apply(model, "compressed_experts")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "compressed_experts" in name:
                p.uniform_(0.5, 1.5)  # vectors away from their all-ones start
        expected = model(**random_batch()).logits
    out = patch.export(tmp_path / "export")
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert install_exported_routing(vanilla, out).method == "compressed_experts"
    with torch.no_grad():
        torch.testing.assert_close(vanilla(**random_batch()).logits, expected)


def test_plain_export_keeps_hf_routing(tmp_path):
    model = build_tiny("olmoe")
    out = moe_lab.apply(model, "sft").export(tmp_path / "export")
    assert install_exported_routing(transformers.AutoModelForCausalLM.from_pretrained(out), out) is None
