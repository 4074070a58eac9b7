"""method.lora exports a PEFT adapter (<export>/adapter/) that ``PeftModel.from_pretrained`` loads on the
vanilla base model and that reproduces the trained model's logits.

Oracle: the trained moe-lab model's own forward (its LinearLoRA hooks and PackedLoRA parametrizations) vs.
PEFT's LoRA layers on a freshly built vanilla model of the same seed, i.e. PEFT's code, not moe-lab's.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

peft = pytest.importorskip("peft")
from safetensors.torch import load_file

from moe_lab.methods.base import MoELightningModule
from moe_lab.methods.peft_export import ADAPTER_DIR
from tests.conftest import build_tiny, random_batch

# olmoe: packed experts only, a trained router; deepseek_v3: dense MLP + shared experts whose names PEFT
# rewrites for v5 (targeted as parameters), router with a correction-bias buffer; gpt_oss: [E, in, out]
# experts; qwen2_moe: a shared expert as a plain PEFT target module; llama4_text: [E, in, out] experts without HF's
# is_transposed flag, a router that is an nn.Linear subclass, dense MLP layers between the MoE ones; aria_text:
# [E, in, out] experts with the flag, chunked gate / up columns, shared experts as plain PEFT target modules.
CASES = [("olmoe", "sft"), ("deepseek_v3", "sft"), ("gpt_oss", "sft"), ("qwen2_moe", "frozen_router"),
         *(pytest.param(f, "sft", marks=pytest.mark.slow) for f in ("llama4_text", "aria_text"))]


def _train(family: str, method: str) -> MoELightningModule:
    torch.manual_seed(0)
    module = MoELightningModule(build_tiny(family), method=method, lora={"rank": 4, "alpha": 8},
                                optim={"lr": 3e-2})
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, DataLoader([random_batch(batch=2, seq=10, seed=s) for s in range(2)], batch_size=None))
    return module


@pytest.mark.parametrize("family,method", CASES)
def test_peft_adapter_reproduces_trained_logits(tmp_path, family, method):
    module = _train(family, method)
    export = module.patch.export(tmp_path / "export")
    adapter = export / ADAPTER_DIR
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert bool(config["modules_to_save"]) == (method == "sft")  # a trained router is saved whole

    batch = random_batch(batch=2, seq=10, seed=7)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    module.model.eval()
    with torch.no_grad():
        trained = module.model(**inputs).logits
        loaded = peft.PeftModel.from_pretrained(build_tiny(family), adapter).eval()
        got = loaded(**inputs).logits
        vanilla = build_tiny(family).eval()(**inputs).logits
    # PEFT adds the same products, but merges parameter-targeted deltas into the weight (W + sBA) where moe-lab
    # adds them to the activations: fp32 rounding of one matmul chain per layer
    cfg = module.model.config
    tol = torch.finfo(torch.float32).eps * cfg.hidden_size * cfg.num_hidden_layers * float(trained.abs().max())
    assert (got - trained).abs().max() <= tol
    assert (vanilla - trained).abs().max() > 100 * tol  # the adapters changed the model


def test_packed_factors_in_peft_layout(tmp_path):
    """The saved packed-expert tensors are moe-lab's B_e @ A_e in PEFT's [out, r, E] x [E, r, in] layout."""
    module = _train("olmoe", "sft")
    adapter = module.patch.export(tmp_path / "export") / ADAPTER_DIR
    state = load_file(adapter / "adapter_model.safetensors")
    experts = module.model.model.layers[0].mlp.experts
    lora = experts.parametrizations["down_proj"][0]
    delta = lora.scale * torch.bmm(lora.lora_B, lora.lora_A)  # [E, out, in]
    key = next(k for k in state if "layers.0.mlp.experts" in k and k.endswith("lora_A.weight")
               and state[k].shape[1] == delta.shape[2])
    a, b = state[key], state[key.replace("lora_A", "lora_B")]
    e = delta.shape[0]
    by_hand = torch.stack([b.reshape(b.shape[0], -1, e)[:, :, i] @ a.reshape(e, -1, a.shape[1])[i]
                           for i in range(e)]) * lora.scale
    assert torch.equal(by_hand, delta)


@pytest.mark.slow
def test_row_blocked_experts_get_no_peft_adapter_and_say_why(tmp_path, caplog):
    """DBRX's experts are [E*I, H] row blocks: PEFT's target_parameters would give each tensor ONE LoRA pair, so
    no adapter is written (a warning names the reason) and the merged export still reloads in vanilla HF."""
    import transformers

    import moe_lab

    model = build_tiny("dbrx")
    patch = moe_lab.apply(model, "sft", lora={"rank": 2, "targets": ["experts", "attention"]})
    with caplog.at_level("WARNING", logger="moe_lab.methods.peft_export"):
        out = patch.export(tmp_path / "export")
    assert not (out / ADAPTER_DIR).exists()
    assert "stores its experts as row blocks of a 2-D tensor" in caplog.text
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    batch = random_batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model.eval()(**batch).logits, rtol=1e-5, atol=1e-6)
