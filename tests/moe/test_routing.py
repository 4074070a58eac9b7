"""moe-lab's routing rules and per-expert slices against the HF modules they replace; bad input."""

from __future__ import annotations

import pytest
import torch

import moe_lab
from moe_lab.models import build_config
from moe_lab.moe import find_moe_layers, supported_families
from moe_lab.moe.block import ConventionalRouting
from moe_lab.moe.experts import expert_forward, expert_mixture
from moe_lab.moe.routing import RoutingRule, select_topk
from tests.conftest import ALL_FAMILIES, build_tiny, hf_route, tiny_model_cfg

VARIANTS = [(f, {}) for f in ALL_FAMILIES] + [
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3}),
    ("deepseek_v2", {"routed_scaling_factor": 16.0}),
    # top_k beyond the kept groups (HF accepts it): V2 weighs those experts 0.0, V3 reads their scores
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1, "num_experts_per_tok": 5}),
    ("deepseek_v3", {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 8}),
    ("deepseek_v3", {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}),
    ("deepseek_v3", {"norm_topk_prob": False}),
    ("olmoe", {"norm_topk_prob": True}),
    ("qwen2_moe", {"num_experts_per_tok": 4}),
    ("cohere2_moe", {"expert_selection_fn": "sigmoid"}),
    ("llama4_text", {"num_experts_per_tok": 3}),
]


@pytest.mark.filterwarnings("ignore:top_k=.*exceeds")
@pytest.mark.parametrize("family,overrides", VARIANTS, ids=lambda v: str(v))
def test_routing_equals_hf_router(family, overrides):
    model = build_tiny(family, **overrides).eval()
    x = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    for view in find_moe_layers(model):
        hf_logits, hf_weights, hf_idx = hf_route(view, view.router, x)
        logits, weights, idx = ConventionalRouting(view)(view.router, x)
        torch.testing.assert_close(logits, hf_logits, rtol=0, atol=0)
        assert torch.equal(idx, hf_idx)
        torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
        assert weights.dtype == hf_weights.dtype


def test_every_registry_family_has_a_tiny_config():
    assert sorted(ALL_FAMILIES) == supported_families()
    for family in supported_families():
        assert tiny_model_cfg(family).family == family


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_expert_slice_forward_equals_hf_experts(family):
    model = build_tiny(family).eval()
    view = find_moe_layers(model)[0]
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    for e in (0, view.num_experts - 1):
        idx = torch.full((5, 1), e)
        expected = expert_mixture(view, x, torch.ones(5, 1), idx)  # HF's experts module (DBRX's [N, 1, H] viewed as [N, H])
        # the same per-expert operations as HF's packed loop (weight 1.0, added into zeros): bit for bit
        assert torch.equal(expert_forward(view, e, x), expected)


def test_views_record_dense_layers():
    model = build_tiny("deepseek_v3")
    patch = moe_lab.apply(model)
    assert patch.dense_layers == [0]
    assert [layer.index for layer in patch.layers] == [1, 2]
    qwen2 = moe_lab.apply(build_tiny("qwen2_moe"))
    assert qwen2.dense_layers == [1] and [layer.index for layer in qwen2.layers] == [0, 2]


def test_top_k_larger_than_experts_names_the_field():
    cfg = tiny_model_cfg("olmoe", num_experts_per_tok=9)
    with pytest.raises(ValueError, match="top_k=9.*num_experts=8.*num_experts_per_tok"):
        build_config(cfg.config_class, cfg.config)


def test_top_k_beyond_the_kept_groups_warns_as_hf_accepts_it():
    cfg = tiny_model_cfg("deepseek_v3", num_experts_per_tok=5)
    with pytest.warns(UserWarning, match="top_k=5 exceeds the 4 experts reachable in topk_group=1"):
        build_config(cfg.config_class, cfg.config)


def test_v2_experts_outside_the_kept_groups_weigh_zero():
    """Independent check of HF's V2 rule: weights outside the kept group are 0, inside the probabilities."""
    model = build_tiny("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=1,
                       num_experts_per_tok=4, routed_scaling_factor=1.0)
    view = find_moe_layers(model)[0]
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    _, weights, idx = ConventionalRouting(view)(view.router, x)
    probs = torch.softmax(x @ view.router_weight.T, dim=-1)
    best_group = probs.view(9, 4, 2).amax(-1).argmax(-1)
    in_group = idx // 2 == best_group[:, None]
    assert int(in_group.sum(-1).min()) == 2  # both experts of the kept group, then two from dropped groups
    torch.testing.assert_close(weights[in_group], probs.gather(1, idx)[in_group], rtol=1e-6, atol=0)
    assert torch.equal(weights[~in_group], torch.zeros(int((~in_group).sum())))


def test_v2_group_limit_under_a_selection_bias_and_forced_experts():
    """Methods on group-limited V2: dropped groups stay below every kept expert whatever the bias sign (HF's
    0.0 fill assumes probabilities), their experts weigh 0, and a forced expert keeps its probability."""
    rule = RoutingRule(score="softmax", top_k=3, num_experts=8, n_group=4, topk_group=1, group_fill=0.0,
                       group_masks_weights=True, sorted_topk=False)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))
    probs = torch.softmax(logits, dim=-1)
    kept = logits.view(6, 4, 2).amax(-1).argmax(-1)  # a uniform bias does not change which group wins
    weights, idx = select_topk(rule, logits, False, selection_bias=torch.full((8,), -5.0))
    in_group = idx // 2 == kept[:, None]
    assert in_group.sum(-1).tolist() == [2] * 6
    assert torch.equal(weights[in_group], probs.gather(1, idx)[in_group])
    assert torch.equal(weights[~in_group], torch.zeros(6))
    forced = torch.tensor([7])
    weights, idx = select_topk(rule, logits, False, selection_bias=torch.zeros(8), forced=forced)
    assert bool((idx == 7).any(-1).all())
    assert torch.equal(weights[idx == 7], probs[:, 7])


def test_topk_group_out_of_range_names_the_field():
    cfg = tiny_model_cfg("deepseek_v3", topk_group=3)
    with pytest.raises(ValueError, match="topk_group=3 must be between 1 and n_group=2"):
        build_config(cfg.config_class, cfg.config)


def test_unsupported_model_type_lists_supported():
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=16, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="unsupported model_type 'llama'.*olmoe"):
        moe_lab.apply(model)


def test_unknown_method_and_option():
    model = build_tiny("olmoe")
    with pytest.raises(ValueError, match="unknown method 'dense_mixer'.*frozen_router.*sft"):
        moe_lab.apply(model, "dense_mixer")
    with pytest.raises(TypeError, match="unknown option.*'gamma'"):
        moe_lab.apply(model, "sft", gamma=1e-3)
    moe_lab.apply(model)
    with pytest.raises(ValueError, match="already has moe-lab blocks"):
        moe_lab.apply(model)


def test_frozen_router_freezes_router_only():
    model = build_tiny("gpt_oss")
    patch = moe_lab.apply(model, "frozen_router")
    groups = patch.parameter_groups()
    assert groups["router"] and all(not p.requires_grad for _, p in groups["router"])
    assert all(p.requires_grad for g in ("experts", "attention") for _, p in groups[g])


def test_parameter_groups_partition_the_model():
    model = build_tiny("qwen2_moe")
    groups = moe_lab.apply(model).parameter_groups()
    names = [n for g in groups.values() for n, _ in g]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert {n.rsplit(".", 1)[-1] for n, _ in groups["experts"]} == {"gate_up_proj", "down_proj"}
    assert any("shared_expert_gate" in n for n, _ in groups["shared_experts"])
    assert any("embed_tokens" in n for n, _ in groups["embeddings"])
    assert any("self_attn" in n for n, _ in groups["attention"])


@pytest.mark.parametrize("family", ["olmoe", "hunyuan_v1_moe", "afmoe"])  # router weight "weight", "wg.weight", "gate.weight"
def test_routing_reads_a_router_weight_that_is_not_a_parameter(family):
    """FSDP with ``use_orig_params`` replaces each parameter, during forward, with a plain-tensor view of its flat
    parameter. The installed routing must read that tensor (``get_parameter`` refused it on the H100 run:
    "`weight` is not an nn.Parameter"). Oracle: the same model's logits before the replacement."""
    model = build_tiny(family).eval()
    patch = moe_lab.apply(model, "sft")
    batch = {"input_ids": torch.arange(3, 15).view(2, 6)}
    with torch.no_grad():
        want = model(**batch).logits
        for view in patch.views:
            owner_path, _, name = view.spec.router_weight_attr.rpartition(".")
            owner = view.router.get_submodule(owner_path) if owner_path else view.router
            tensor = getattr(owner, name).detach().clone()
            delattr(owner, name)
            setattr(owner, name, tensor)  # as FSDP's _use_unsharded_views does: a Tensor attribute, no Parameter
            assert not isinstance(getattr(owner, name), torch.nn.Parameter)
        got = model(**batch).logits
    assert torch.equal(got, want)
