"""Exports of a bf16-loaded model trained with fp32 master weights: every tensor in the load dtype (bf16), the
ones HF keeps in fp32 excepted, for the LoRA merge and the plain export alike, and ``config.json`` says bf16.

Oracle: the in-memory trained model itself. Its adapted weights are read through its own forward definitions
(the packed-expert parametrization's output, ``weight + lora.delta()`` of the linear adapters), on a deep
copy whose moe-lab blocks are removed; that vanilla copy's parameters are cast to bf16. A vanilla
``AutoModelForCausalLM.from_pretrained`` of the export must hold the same bf16 tensors and give the same
logits (``torch.equal``: both are one rounding of the same fp32 values, run through the same HF code).
"""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
import transformers
from safetensors import safe_open
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader

from moe_lab.core.precision import export_in_load_dtype
from moe_lab.methods.base import MoELightningModule
from moe_lab.methods.lora import LinearLoRA
from moe_lab.models import load_model
from tests.conftest import hf_fp32_names, random_batch, tiny_model_cfg


def _trained(family: str, lora: dict | None) -> MoELightningModule:
    cfg = tiny_model_cfg(family)
    cfg.dtype = "bfloat16"
    model, _ = load_model(cfg)
    module = MoELightningModule(model, "sft", lora=lora, optim={"lr": 1e-2, "weight_decay": 0.0})
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", precision="bf16-mixed")
    trainer.fit(module, DataLoader([random_batch(batch=2, seq=8)], batch_size=None))
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)  # master weights: the mixed case
    return module


def _oracle(module: MoELightningModule) -> torch.nn.Module:
    """A vanilla bf16 copy holding the in-memory model's adapted weights, each rounded once."""
    module = copy.deepcopy(module)
    model = module.patch.remove()
    with torch.no_grad():
        for owner in list(model.modules()):
            for name in list(getattr(owner, "parametrizations", {})):
                adapted = getattr(owner, name).detach().clone()  # W + scale * B @ A, fp32
                parametrize.remove_parametrizations(owner, name, leave_parametrized=False)
                getattr(owner, name).data = adapted
            lora = getattr(owner, "lora", None)
            if isinstance(lora, LinearLoRA):
                owner.weight.data = (owner.weight + lora.delta()).detach()
                owner._forward_hooks.clear()
                del owner.lora
    kept = hf_fp32_names(model.config.model_type)
    for name, param in model.named_parameters():  # buffers (rotary frequencies, DeepSeek-V3's bias) stay as loaded
        if not name.endswith(kept):  # what HF keeps in fp32 (DeepSeek-V3's router from transformers 5.24) too
            param.data = param.data.to(torch.bfloat16)
    return model.eval()


def _file_dtypes(path) -> dict[str, str]:
    """Each tensor's dtype as stored in a safetensors file."""
    with safe_open(str(path), "pt") as f:
        names = f.keys()
        return {key: f.get_slice(key).get_dtype() for key in names}


def _check_export(module: MoELightningModule, path) -> None:
    kept = hf_fp32_names(module.model.config.model_type)
    dtypes = _file_dtypes(path / "model.safetensors")
    assert {d for k, d in dtypes.items() if not k.endswith(kept)} == {"BF16"}, dtypes
    assert all(d == "F32" for k, d in dtypes.items() if k.endswith(kept))
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    oracle = _oracle(module)
    want = dict(oracle.state_dict())
    for key, value in reloaded.state_dict().items():
        assert value.dtype == (torch.float32 if key.endswith(kept) else torch.bfloat16), key
        assert torch.equal(value, want[key]), key
    batch = random_batch(batch=2, seq=8, seed=3)
    with torch.no_grad():
        got = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected = oracle(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_merged_lora_export_is_all_load_dtype(family, tmp_path):
    module = _trained(family, {"rank": 4, "alpha": 8})
    module.patch.export(tmp_path / "export")
    _check_export(module, tmp_path / "export")
    adapter = _file_dtypes(tmp_path / "export" / "adapter" / "adapter_model.safetensors")
    kept = hf_fp32_names(module.model.config.model_type)
    assert {d for k, d in adapter.items() if not k.endswith(kept)} == {"BF16"}, adapter


def test_plain_export_writes_master_weights_in_load_dtype(tmp_path):
    module = _trained("olmoe", None)  # full fine-tuning: the embedding, the first parameter, is fp32 now
    export_in_load_dtype(module.patch)  # what task=finetune does before its export
    module.patch.export(tmp_path / "export")
    _check_export(module, tmp_path / "export")
    assert module.model.config.dtype == "bfloat16"
