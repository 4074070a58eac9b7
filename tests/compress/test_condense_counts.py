"""Spec 3.9 memory ratios reproduced by REAL surgery (CondensedLayer / LayerTrim / BlockTrim) on meta-device
models built from the public configs (independent of moe_lab.analysis.estimate's arithmetic)."""

from __future__ import annotations

import copy

import torch
from omegaconf import OmegaConf

from moe_lab.analysis.estimate import architecture_config
from moe_lab.analysis.meta_costs import meta_model, quiet_init
from moe_lab.compress.condense import build_condensed, replace_module
from moe_lab.compress.condense_search import trim
from moe_lab.moe.view import find_moe_layers
from tests.conftest import ROOT


def params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def condensed(model, layers, routed):
    model = copy.deepcopy(model)
    for view in find_moe_layers(model):
        if view.index in layers:
            module = build_condensed(view, None, list(range(routed)), gates=torch.zeros(view.num_experts))
            replace_module(model, view.name, module)
    return model


def build(name=None, config=None):
    if config is None:
        config = architecture_config(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"))
    with quiet_init():
        return meta_model(config)


def test_qwen1_5_moe_memory_ratios_by_surgery():
    model = build("qwen1_5_moe")
    total = params(model)
    assert total == 14_315_784_192
    first6 = list(range(6))
    ratio = {
        "s": params(condensed(model, first6, 0)) / total,
        "sr": params(condensed(model, first6, 4)) / total,
        "layer_trim": params(trim(copy.deepcopy(model), first6, "moe")) / total,
        "block_trim": params(trim(copy.deepcopy(model), first6, "block")) / total,
    }
    assert {k: round(100 * v, 2) for k, v in ratio.items()} == {
        "s": 78.24, "sr": 79.69, "layer_trim": 76.79, "block_trim": 76.09}


def test_deepseekmoe_16b_memory_ratios_by_surgery():
    """DeepSeekMoE-16B's MoE layers built with transformers' DeepseekV2 classes (same block: 64 x 1408 routed +
    2 x 1408 shared, top-6, softmax without renormalisation); its MHA attention (4 h^2, no MLA in v2 classes)
    and the model total 16,375,728,128 (spec 3.9) are typed in."""
    import transformers

    h = 2048
    config = transformers.DeepseekV2Config(
        vocab_size=102400, hidden_size=h, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, num_hidden_layers=3, first_k_dense_replace=1,
        topk_method="greedy", num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False)
    model = build(config=config)
    block = model.get_submodule("model.layers.1.mlp")
    moe_block = params(block)
    assert moe_block == 64 * 3 * h * 1408 + 64 * h + 3 * h * 2 * 1408
    total = 16_375_728_128
    removed = {r: moe_block - params(condensed(model, [1], r).get_submodule("model.layers.1.mlp")) for r in (0, 6)}
    dense_trim = moe_block - params(trim(copy.deepcopy(model), [1], "moe").get_submodule("model.layers.1.mlp"))
    attention_and_norms = 4 * h * h + 2 * h
    ratio = {"s": 1 - 8 * removed[0] / total, "sr": 1 - 9 * removed[6] / total,
             "layer_trim": 1 - 8 * dense_trim / total,
             "block_trim": 1 - 8 * (moe_block + attention_and_norms) / total}
    assert {k: round(100 * v, 2) for k, v in ratio.items()} == {
        "s": 72.95, "sr": 72.42, "layer_trim": 72.10, "block_trim": 71.28}
    # lightweight-SFT trainable fraction (spec 3.8): shared + 6 retained experts of 9 condensed layers
    retained = params(condensed(model, [1], 6).get_submodule("model.layers.1.mlp"))
    assert 9 * retained == 622_854_144


def test_converted_deepseekmoe_16b_counts_and_ratios():
    """conf/model/deepseek_moe_16b (the Qwen2-MoE form of moe_lab.convert): the spec-3.9 total plus one zero
    shared-expert gate (2048) per MoE layer, and the same memory ratios by surgery on all 28 layers."""
    model = build("deepseek_moe_16b")
    total = params(model)
    assert total == 16_375_728_128 + 27 * 2048
    eight, nine = list(range(1, 9)), list(range(1, 10))
    ratio = {"s": params(condensed(model, eight, 0)) / total, "sr": params(condensed(model, nine, 6)) / total,
             "layer_trim": params(trim(copy.deepcopy(model), eight, "moe")) / total,
             "block_trim": params(trim(copy.deepcopy(model), eight, "block")) / total}
    assert {k: round(100 * v, 2) for k, v in ratio.items()} == {
        "s": 72.95, "sr": 72.42, "layer_trim": 72.10, "block_trim": 71.28}
