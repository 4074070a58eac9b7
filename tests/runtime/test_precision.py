"""fp32 master weights: a bf16-loaded model trained through the LightningModule under bf16 autocast takes
the same step as AdamW on fp32 copies computed by hand; the runs that would drop updates are refused."""

from __future__ import annotations

import copy
import logging

import lightning as L
import pytest
import torch
import transformers
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from moe_lab.core.precision import in_load_dtype, keep_hf_fp32, plan_master_weights
from moe_lab.methods.base import MoELightningModule
from moe_lab.models import load_model
from tests.conftest import ROOT, build_tiny, hf_fp32_names, random_batch, tiny_model_cfg

LR = 2e-5


def _bf16_model(family="olmoe"):
    cfg = tiny_model_cfg(family)
    cfg.dtype = "bfloat16"
    model, _ = load_model(cfg)
    return model


def _fit_one_step(model, precision="bf16-mixed", method="sft", **kwargs):
    module = MoELightningModule(model, method, optim={"lr": LR, "weight_decay": 0.0}, **kwargs)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", precision=precision)
    trainer.fit(module, DataLoader([random_batch(batch=2, seq=8)], batch_size=None))
    return module


def _oracle_step(bf16_model):
    """The same step by hand: fp32 copies of the parameters, forward/backward under CPU bf16 autocast with the
    packed expert tensors cast to bf16 as autocast casts every linear weight (HF's grouped expert matmul is not
    autocast-enabled; moe-lab casts them), torch.optim.AdamW on the copies. Returns (parameters after the step,
    gradients)."""
    model = copy.deepcopy(bf16_model).train()
    for p in model.parameters():
        p.data = p.data.float()
    opt = torch.optim.AdamW(list(model.parameters()), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    experts = {n: p.to(torch.bfloat16) for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.func.functional_call(model, experts, kwargs=random_batch(batch=2, seq=8)).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads


def _changed_fraction(after: dict, before: dict, grads: dict) -> float:
    """Fraction of entries with a non-zero gradient whose value changed."""
    changed = total = 0
    for n, g in grads.items():
        live = g != 0
        changed += int((after[n].float() != before[n].float())[live].sum())
        total += int(live.sum())
    return changed / total


def test_bf16_model_trains_with_fp32_master_weights_like_the_oracle(caplog):
    base = _bf16_model()
    assert base.model.norm.weight.dtype == torch.bfloat16 and torch.all(base.model.norm.weight == 1)
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    expected, grads = _oracle_step(base)
    model = copy.deepcopy(base)
    with caplog.at_level(logging.INFO, logger="moe_lab.core.precision"):
        _fit_one_step(model)
    assert any("master weights: upcast" in r.getMessage() and "bfloat16 to float32" in r.getMessage()
               for r in caplog.records)
    got = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 for p in got.values())
    for n, value in expected.items():
        assert torch.equal(got[n].detach(), value), n
    assert _changed_fraction(expected, before, grads) == 1.0
    norm = got["model.norm.weight"].detach()
    assert torch.all(norm[grads["model.norm.weight"] != 0] != 1.0), "a ones-initialised vector moves"


def test_bf16_parameters_without_master_weights_drop_most_updates():
    """What the fix prevents (``master_weights=off``): AdamW on bf16 tensors at lr 2e-5."""
    base = _bf16_model()
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    _, grads = _oracle_step(base)
    model = copy.deepcopy(base)
    _fit_one_step(model, master_weights="off")
    after = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in after.values())
    assert _changed_fraction(after, before, grads) < 0.5
    assert torch.all(after["model.norm.weight"] == 1.0)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_frozen_parameters_keep_the_load_dtype_and_buffers_stay_fp32(family):
    """Frozen routers keep the dtype HF loaded them in: bf16 (OLMoE), fp32 where HF keeps them in fp32 (DeepSeek-V3's
    from transformers 5.24); trained parameters become fp32; DeepSeek-V3's fp32 correction bias stays fp32."""
    model = _bf16_model(family)
    kept = hf_fp32_names(family)
    loaded = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == (torch.float32 if n.endswith(kept) else torch.bfloat16) for n, d in loaded.items()), loaded
    fp32_buffers = {n for n, b in model.named_buffers() if n.endswith(kept)}
    assert all(b.dtype == torch.float32 for n, b in model.named_buffers() if n in fp32_buffers)
    assert bool(fp32_buffers) == (family == "deepseek_v3")
    _fit_one_step(model, method="frozen_router")
    for n, p in model.named_parameters():
        assert p.dtype == (loaded[n] if n.endswith("mlp.gate.weight") else torch.float32), n
    assert all(b.dtype == torch.float32 for n, b in model.named_buffers() if n in fp32_buffers)


def test_full_precision_trainer_upcasts_frozen_half_weights_too():
    model = _bf16_model()
    _fit_one_step(model, precision="32-true", method="frozen_router")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_check_mode_refuses_naming_the_fields():
    with pytest.raises(ValueError, match=r"model\.dtype=bfloat16.*trainer\.precision=bf16-mixed"):
        _fit_one_step(_bf16_model(), master_weights="check")


def test_bf16_true_is_refused_unless_off():
    with pytest.raises(ValueError, match=r"trainer\.precision=bf16-true.*bf16-mixed.*master_weights=off"):
        _fit_one_step(_bf16_model(), precision="bf16-true")
    model = _bf16_model()
    _fit_one_step(model, precision="bf16-true", master_weights="off")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_plan_units():
    model = _bf16_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert plan_master_weights(model, "bf16-mixed") == trainable
    assert plan_master_weights(model, "bf16-mixed", optimizer_keeps_fp32=True) == []  # DeepSpeed
    assert plan_master_weights(model.float(), "bf16-mixed", "check") == []
    with pytest.raises(ValueError, match="method.master_weights='fp16'"):
        MoELightningModule(_bf16_model(), "sft", master_weights="fp16")


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v2", "deepseek_v3"])
def test_fp32_kept_tensors_follow_vanilla_from_pretrained(family, tmp_path):
    """A bf16 model cast wholly to bf16 (as DeepSpeed's engine does): ``keep_hf_fp32`` brings back exactly the dtypes
    vanilla ``from_pretrained(dtype=bf16)`` gives each tensor, and ``in_load_dtype`` writes those dtypes."""
    build_tiny(family).save_pretrained(tmp_path)
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = {k: v.dtype for k, v in vanilla.state_dict().items()}
    assert (torch.float32 in want.values()) == bool(hf_fp32_names(family))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).bfloat16()
    assert {v.dtype for v in model.state_dict().values()} == {torch.bfloat16}
    assert {k: v.dtype for k, v in in_load_dtype(model, model.state_dict()).items()} == want
    keep_hf_fp32(model, torch.bfloat16)
    assert {k: v.dtype for k, v in model.state_dict().items()} == want


def test_gpu_config_is_mixed_precision():
    hardware = OmegaConf.load(ROOT / "conf" / "hardware" / "gpu.yaml")
    assert hardware.trainer.precision == "bf16-mixed"
