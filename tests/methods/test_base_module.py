"""The base LightningModule: response-only loss, aux-loss mapping without double counting (schedules:
test_schedules.py; DeepSeek losses and native coefficients: test_baselines.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from moe_lab.methods.base import MoELightningModule
from moe_lab.models import load_model
from tests.conftest import build_tiny, random_batch, tiny_model_cfg


def _independent_loss(model, batch, coef):
    """CE over shifted labels (ignore -100) + coef x Switch loss on the router logits, computed by hand."""
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
    ce = F.cross_entropy(logits, batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    cfg = model.config
    if hasattr(cfg, "ffn_config"):  # DBRX: routing sizes in ffn_config
        experts, top_k = cfg.ffn_config.moe_num_experts, cfg.ffn_config.moe_top_k
    else:
        experts = cfg.num_local_experts if hasattr(cfg, "num_local_experts") else cfg.num_experts
        top_k = cfg.num_experts_per_tok
    aux = load_balancing_loss_func(out.router_logits, experts, top_k, batch["attention_mask"])
    return ce + coef * aux


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", pytest.param("dbrx", marks=pytest.mark.slow)])  # DBRX: ffn_config.moe_loss_weight
def test_aux_loss_added_exactly_once(family):
    model = build_tiny(family).eval()
    module = MoELightningModule(model, "sft", aux_loss_coef=0.25)
    batch = random_batch()
    batch["labels"][:, :4] = -100  # prompt tokens carry no loss
    with torch.no_grad():
        got = module._step(batch, "train")
    expected = _independent_loss(model, batch, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dbrx_coefficient_reaches_the_config_path_and_hfs_own_loss():
    """DBRX keeps its coefficient in ffn_config.moe_loss_weight and copies it into the model's router_aux_loss_coef
    at init: the mapped coefficient must reach both, so HF's own loss is CE + 0.25 * aux."""
    import moe_lab

    model = build_tiny("dbrx").eval()
    patch = moe_lab.apply(model, "sft")
    assert patch.set_aux_loss_coef(0.25)
    assert model.config.ffn_config.moe_loss_weight == 0.25 == model.router_aux_loss_coef
    batch = random_batch()
    with torch.no_grad():
        out = model(**batch)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                         ignore_index=-100)
    torch.testing.assert_close(out.loss, ce + 0.25 * out.aux_loss, rtol=1e-6, atol=1e-7)


def test_aux_loss_off_gives_plain_response_ce():
    model = build_tiny("qwen2_moe").eval()
    module = MoELightningModule(model, "sft", aux_loss_coef=0.0)
    batch = random_batch()
    batch["labels"][:, :5] = -100
    with torch.no_grad():
        got = module._step(batch, "train")
    torch.testing.assert_close(got, _independent_loss(model, batch, 0.0), rtol=1e-5, atol=1e-6)


def test_unreachable_hub_id_names_the_local_path_override(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=r"model.pretrained=/local/path/to/OLMoE-1B-7B-0924"):
        load_model({"pretrained": "allenai/OLMoE-1B-7B-0924", "dtype": "bfloat16"})


def test_vocab_smaller_than_tokenizer_names_the_field():
    cfg = tiny_model_cfg("olmoe", vocab_size=100)
    with pytest.raises(ValueError, match="model.config.vocab_size=100"):
        load_model(cfg)


def test_tiny_models_are_seeded():
    a, _ = load_model(tiny_model_cfg("mixtral"))
    b, _ = load_model(tiny_model_cfg("mixtral"))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_packed_batches_count_only_real_tokens_and_train():
    from moe_lab.data.packing import packed_collate
    from moe_lab.methods.base import MoELightningModule
    from tests.conftest import build_tiny

    module = MoELightningModule(build_tiny("olmoe"), method="sft")
    module.train()
    rows = [[{"input_ids": [1, 5, 6, 7], "labels": [1, 5, 6, 7]}, {"input_ids": [1, 8, 9], "labels": [1, 8, 9]}],
            [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]]
    batch = packed_collate(rows, pad_id=0)
    real = int(batch["token_mask"].sum())
    assert real == 10 and batch["input_ids"].numel() > real
    module.patch.reset_counts()
    loss = module._step(batch, "val")
    assert torch.isfinite(loss)
    top_k = module.patch.layers[0].top_k
    assert all(int(layer.counts.sum()) == real * top_k for layer in module.patch.layers)
