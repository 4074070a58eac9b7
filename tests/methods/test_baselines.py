"""Baselines as the papers define them: method=sft uses the model's own aux loss at its native coefficient
(HF config-class default or the loaded config), DeepSeek-V2 its sequence-wise balance loss (hand-computed
here from the vanilla HF routers' logits and indices, padding excluded), sft_aux_free none."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from omegaconf import OmegaConf

import moe_lab
from moe_lab.methods.base import MoELightningModule
from moe_lab.moe.aux_loss import sequence_balance_loss
from tests.conftest import FAMILIES, ROOT, build_tiny, random_batch

NATIVE_FROM_REGISTRY = {"deepseek_v2": 0.001, "deepseek_v3": 0.0}  # HF's DeepSeek config classes have no field


@pytest.mark.parametrize("family", FAMILIES)
def test_native_coefficient_is_the_config_class_default(family):
    model = build_tiny(family)
    module = MoELightningModule(model, "sft", aux_loss_coef="native")
    if family in NATIVE_FROM_REGISTRY:
        assert not hasattr(type(model.config)(), "router_aux_loss_coef")
        assert module.aux_loss_coef == NATIVE_FROM_REGISTRY[family]
    else:
        assert module.aux_loss_coef == type(model.config)().router_aux_loss_coef
    assert model.config.output_router_logits == (module.aux_loss_coef > 0)


def test_loaded_config_value_wins():
    olmoe = MoELightningModule(build_tiny("olmoe", router_aux_loss_coef=0.02), "sft", aux_loss_coef="native")
    assert olmoe.aux_loss_coef == 0.02
    v2 = MoELightningModule(build_tiny("deepseek_v2", aux_loss_alpha=0.003), "sft", aux_loss_coef="native")
    assert v2.aux_loss_coef == 0.003
    with pytest.raises(ValueError, match="method.aux_loss_coef='natve'"):
        MoELightningModule(build_tiny("olmoe"), "sft", aux_loss_coef="natve")


def _hf_routing(vanilla, batch):
    """(logits, indices) recorded from the vanilla HF routers (forward hooks), and the model output."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((out[0], out[2])))
             for m in vanilla.modules() if type(m).__name__.endswith("TopkRouter")]
    out = vanilla(**batch)
    for h in hooks:
        h.remove()
    return seen, out


def _oracle_sequence_loss(seen, mask, normalise=False, segments=None):
    """DeepSeek-V2's MoEGate formula (seq_aux=True) applied to each sequence's real tokens, summed over layers:
    ce = scatter_add(ones at top-k ids) / (T K / E); loss = mean_b sum_e ce_e * mean_t s_{t,e}."""
    total = 0.0
    for logits, indices in seen:
        num_experts, top_k = logits.shape[-1], indices.shape[-1]
        scores = logits.sigmoid() if normalise else logits.softmax(dim=-1, dtype=torch.float32)
        if normalise:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        rows = mask.shape[0]
        scores, indices = scores.view(rows, -1, num_experts), indices.view(rows, -1, top_k)
        per_sequence = []
        for b in range(rows):
            seg = segments[b] if segments is not None else torch.zeros_like(mask[b])
            for doc in seg.unique().tolist():
                real = (mask[b] > 0) & (seg == doc)
                if not real.any():
                    continue
                t = int(real.sum())
                ce = torch.zeros(num_experts).scatter_add_(0, indices[b][real].reshape(-1), torch.ones(t * top_k))
                ce = ce / (t * top_k / num_experts)
                per_sequence.append((ce * scores[b][real].mean(dim=0)).sum())
        total = total + torch.stack(per_sequence).mean()
    return total


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_sequence_loss_equals_its_modeling_code(topk_method):
    model = build_tiny("deepseek_v2", topk_method=topk_method).train()
    vanilla = copy.deepcopy(model)
    batch = random_batch(batch=3, seq=10)  # rows 1 and 2 are left-padded
    seen, ref = _hf_routing(vanilla, batch)
    expected = _oracle_sequence_loss(seen, batch["attention_mask"])
    module = MoELightningModule(model, "sft", aux_loss_coef="native")
    assert module._moe_lab_adds_aux and module.aux_loss_coef == 0.001
    got_total = module._step(batch, "train")
    torch.testing.assert_close(got_total, ref.loss + 0.001 * expected, rtol=1e-6, atol=1e-7)
    # the loss alone and its router gradient
    out = model(**batch, output_router_logits=True)
    got = sequence_balance_loss(out.router_logits, module.patch.views, batch["attention_mask"])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    grads = torch.autograd.grad(got, [v.router.weight for v in module.patch.views])
    seen, _ = _hf_routing(vanilla, batch)
    want = torch.autograd.grad(_oracle_sequence_loss(seen, batch["attention_mask"]),
                               [m.weight for m in vanilla.modules() if type(m).__name__.endswith("TopkRouter")])
    for g, w in zip(grads, want):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)


def test_padding_is_excluded():
    """Padding tokens change nothing: the loss of a padded batch equals that of its unpadded rows."""
    model = build_tiny("deepseek_v2").eval()
    patch = moe_lab.apply(model, "sft")
    batch = random_batch(batch=2, seq=8, pad_rows=((1, 3),))
    out = model(**batch, output_router_logits=True)
    padded = sequence_balance_loss(out.router_logits, patch.views, batch["attention_mask"])
    parts = []
    for row, start in ((0, 0), (1, 3)):
        ids = batch["input_ids"][row:row + 1, start:]
        one = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_router_logits=True)
        parts.append(sequence_balance_loss(one.router_logits, patch.views, torch.ones_like(ids)))
    torch.testing.assert_close(padded, (parts[0] + parts[1]) / 2, rtol=1e-5, atol=1e-7)


def test_packed_documents_are_sequences():
    model = build_tiny("deepseek_v2")
    patch = moe_lab.apply(model, "sft")
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(2 * 9, 8, generator=gen) for _ in patch.views]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 7:] = 0
    documents = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 2, 2, 2, 2, 2, 2]])
    got = sequence_balance_loss(logits, patch.views, mask, documents)
    seen = [(x, x.softmax(-1).topk(2, dim=-1).indices) for x in logits]
    torch.testing.assert_close(got, _oracle_sequence_loss(seen, mask, segments=documents), rtol=1e-6, atol=1e-7)


def test_deepseek_v3_native_is_off_and_explicit_is_the_complementary_sequence_loss():
    model = build_tiny("deepseek_v3").train()
    assert MoELightningModule(copy.deepcopy(model), "sft", aux_loss_coef="native").aux_loss_coef == 0.0
    vanilla = copy.deepcopy(model)
    batch = random_batch(batch=3, seq=10)
    seen, ref = _hf_routing(vanilla, batch)  # HF's group-limited selection with the correction bias
    module = MoELightningModule(model, "sft", aux_loss_coef=0.5)
    got = module._step(batch, "train")
    expected = ref.loss + 0.5 * _oracle_sequence_loss(seen, batch["attention_mask"], normalise=True)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_sft_configs():
    def method(name):
        cfg = OmegaConf.load(ROOT / "conf" / "method" / f"{name}.yaml")
        for parent in cfg.get("defaults", []):
            if parent != "_self_":
                cfg = OmegaConf.merge(method(parent), {k: v for k, v in cfg.items() if k != "defaults"})
        return cfg

    assert method("sft").aux_loss_coef == "native" and method("sft_aux_free").aux_loss_coef == 0.0
    assert method("sft_aux_free").method == "sft" and method("frozen_router").aux_loss_coef == "native"
    assert method("condenser").aux_loss_coef == 0.0
    assert not (ROOT / "conf" / "method" / "sft_aux.yaml").exists()


def test_hf_aux_families_leave_the_loss_to_hf():
    model = build_tiny("olmoe")
    module = MoELightningModule(model, "sft", aux_loss_coef="native")
    assert not module._moe_lab_adds_aux and model.config.router_aux_loss_coef == 0.01
    assert isinstance(model.config, transformers.OlmoeConfig)
