"""Parameter counts of spec 2.14 from the real configs (typed in: the hub is unreachable), on the META device:
teacher total / active and the dense student that ``to_dense`` builds (``target_config`` + ``dense_width``)."""

from __future__ import annotations

import pytest
import torch
import transformers

from moe_lab.compress.dense import dense_width, target_config
from moe_lab.compress.prune import pruned_config
from moe_lab.moe.view import find_moe_layers

REAL_CONFIGS = {
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "attention_bias": False, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6}),
    "DeepSeek-V2-Lite": ("DeepseekV2Config", {
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "norm_topk_prob": False, "tie_word_embeddings": False, "max_position_embeddings": 163840}),
    "GPT-OSS-20B": ("GptOssConfig", {
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "sliding_window": 128, "tie_word_embeddings": False,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "attention_bias": True}),
}
# spec 2.14: (teacher total, teacher active incl. both embeddings and routers, dense student)
SPEC = {
    "Qwen3-30B-A3B": (30_532_122_624, 3_353_032_704, 3_340_449_792),
    "DeepSeek-V2-Lite": (15_706_484_224, 2_661_150_208, 2_659_708_416),
    "GPT-OSS-20B": (20_914_757_184, 4_187_440_704, 4_185_020_736),
}


def _meta(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_spec_parameter_counts_on_meta(name):
    cls, values = REAL_CONFIGS[name]
    config = getattr(transformers, cls)(**values)
    teacher = _meta(config)
    views = find_moe_layers(teacher)
    E, k = views[0].num_experts, views[0].top_k
    per_expert = sum(p[0].numel() for p in views[0].expert_parameters().values())
    total = _count(teacher)
    active = total - len(views) * (E - k) * per_expert
    routers = sum(p.numel() for v in views for p in v.router.parameters())
    spec_total, spec_active, spec_student = SPEC[name]
    assert total == spec_total
    assert active == spec_active
    student = _meta(target_config(config, dense_width(views)))
    student_views = _safe_views(student)  # every layer dense (DeepSeek) -> no MoE blocks
    # one-expert targets (GPT-OSS) keep a zeroed [1, H] router (+ bias): not counted by the spec
    zero_router = sum(p.numel() for v in student_views for p in v.router.parameters())
    assert _count(student) - zero_router == spec_student
    # the bookkeeping of spec 2.8.6: active - routers + layer-0 padding - (k-1) H down biases (GPT-OSS)
    padding = 3 * config.hidden_size * (dense_width(views) - config.intermediate_size) * (
        config.num_hidden_layers - len(views)) if config.model_type == "deepseek_v2" else 0
    down_biases = len(views) * (k - 1) * config.hidden_size if config.model_type == "gpt_oss" else 0
    assert _count(student) - zero_router == active - routers + padding - down_biases


def _safe_views(model):
    try:
        return find_moe_layers(model)
    except ValueError:
        return []


def test_dense_widths_of_the_paper_models():
    widths = {}
    for name, (cls, values) in REAL_CONFIGS.items():
        widths[name] = dense_width(find_moe_layers(_meta(getattr(transformers, cls)(**values))))
    assert widths == {"Qwen3-30B-A3B": 6144, "DeepSeek-V2-Lite": 11264, "GPT-OSS-20B": 11520}


def test_pruned_totals_of_spec_4_4():
    """DeepSeek-V2-Lite total for n' = 64..6 and GPT-OSS-20B for n' = 32..8 (billions, 2 decimals)."""
    expected = {"DeepSeek-V2-Lite": {64: 15.71, 48: 12.11, 32: 8.51, 24: 6.71, 20: 5.81, 16: 4.91, 12: 4.01, 6: 2.66},
                "GPT-OSS-20B": {32: 20.91, 24: 16.13, 18: 12.55, 12: 8.97, 8: 6.58}}
    for name, table in expected.items():
        cls, values = REAL_CONFIGS[name]
        config = getattr(transformers, cls)(**values)
        for n_keep, billions in table.items():
            top_k = min(config.num_experts_per_tok, n_keep)
            assert round(_count(_meta(pruned_config(config, n_keep, top_k))) / 1e9, 2) == billions, (name, n_keep)
