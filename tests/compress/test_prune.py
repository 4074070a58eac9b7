"""Expert pruning (spec 4.2, oracle tests 4.9): identities, the masked-router oracle on vanilla HF, vanilla
reload with n' experts, condensers always kept, group-limited guards."""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from moe_lab.compress import calibrate
from moe_lab.compress.dense import export_compressed
from moe_lab.compress.prune import prune_experts, strategy_counts
from moe_lab.moe.view import find_moe_layers
from tests.conftest import FAMILIES, assert_same_weights, build_tiny, random_batch, rehomed

ATOL = 64 * torch.finfo(torch.float32).eps


@functools.cache
def _teacher(family: str):
    model = build_tiny(family).eval()
    return model, calibrate(model, [random_batch()])


def _logits(model, batch=None):
    batch = batch or random_batch()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@contextlib.contextmanager
def _masked_router_logits(model, removed: dict[int, list[int]]):
    """Run vanilla HF with the removed experts' router logits set to -inf (wraps F.linear for router weights)."""
    routers = {v.router_weight.data_ptr(): removed[v.index] for v in find_moe_layers(model)}
    original = F.linear

    def linear(x, weight, bias=None):
        out = original(x, weight, bias)
        ids = routers.get(weight.data_ptr())
        if ids and weight.shape[0] == out.shape[-1]:
            out = out.index_fill(-1, torch.tensor(ids), float("-inf"))
        return out

    F.linear = linear
    try:
        yield
    finally:
        F.linear = original


@pytest.mark.parametrize("family", [*FAMILIES, "llama4_text"])  # + the input-scaled routing weight
def test_keep_all_is_the_identity_and_every_family_reloads_pruned(family, tmp_path):
    teacher, calibration = _teacher(family)
    pruned = prune_experts(teacher, calibration, keep=8, top_k=teacher.config.num_experts_per_tok)
    assert torch.equal(_logits(pruned), _logits(teacher))
    pruned = prune_experts(teacher, calibration, keep=6, group_balanced=True)  # 3 per group for DeepSeek-V3
    export_compressed(pruned, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert_same_weights(reloaded, pruned)
    assert torch.equal(_logits(rehomed(reloaded)), _logits(pruned))
    assert [v.num_experts for v in find_moe_layers(reloaded)] == [6] * len(find_moe_layers(teacher))


# softmax-router families, GPT-OSS, DBRX and Llama 4 (top-k of the logits, each weight the sigmoid of its own logit):
# slicing == masking the removed logits (DeepSeek-V3's sigmoid scores and correction bias and PhiMoE's sparsemixer
# are not softmax over the logits)
MASKABLE = ["olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "gpt_oss", "mixtral", "llama4_text",
            pytest.param("dbrx", marks=pytest.mark.slow)]  # DBRX: softmax, top-k divided by its p-norm; experts as [E*I, H] row blocks


@pytest.mark.parametrize("family", MASKABLE)
def test_small_moe_equals_vanilla_with_removed_logits_masked(family, tmp_path):
    teacher, calibration = _teacher(family)
    pruned = prune_experts(teacher, calibration, keep=5, score="es_act")
    kept = {int(i): ids for i, ids in pruned.moe_lab_manifest["layers"].items()}
    removed = {i: sorted(set(range(8)) - set(ids)) for i, ids in kept.items()}
    with _masked_router_logits(teacher, removed):
        want = _logits(teacher)
    got = _logits(pruned)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL * float(want.abs().max()))
    # vanilla reload: equal logits, expert counts n'
    export_compressed(pruned, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert_same_weights(reloaded, pruned)
    assert torch.equal(_logits(rehomed(reloaded)), got)
    assert all(v.num_experts == 5 for v in find_moe_layers(reloaded))
    assert json.loads((tmp_path / "compress_manifest.json").read_text())["layers"] == {
        str(i): ids for i, ids in kept.items()}


def test_kept_experts_follow_the_score_and_router_rows_biases_are_sliced():
    teacher, calibration = _teacher("gpt_oss")
    from moe_lab.compress.scores import scores

    es = scores(calibration, "es_act")
    pruned = prune_experts(teacher, calibration, keep=3, top_k=3)  # Small Dense
    assert pruned.config.num_local_experts == 3 and pruned.config.num_experts_per_tok == 3
    for old, new in zip(find_moe_layers(teacher), find_moe_layers(pruned)):
        ids = sorted(torch.sort(-es[old.index], stable=True).indices[:3].tolist())
        assert pruned.moe_lab_manifest["layers"][str(old.index)] == ids
        assert torch.equal(new.router_weight, old.router_weight[ids])
        assert torch.equal(new.router_bias, old.router_bias[ids])
        assert torch.equal(new.experts.down_proj_bias,
                           old.experts.down_proj_bias[ids])


def test_correction_bias_sliced_and_group_limited_guard():
    teacher, calibration = _teacher("deepseek_v3")  # n_group=2 groups of 4, topk_group=1
    with pytest.raises(ValueError, match="group_balanced=True"):
        prune_experts(teacher, calibration, keep=4, score="sf", always_keep={1: [0, 1, 2], 2: [0, 1, 2]})
    pruned = prune_experts(teacher, calibration, keep=4, score="sf", group_balanced=True)
    for old, new in zip(find_moe_layers(teacher), find_moe_layers(pruned)):
        ids = pruned.moe_lab_manifest["layers"][str(old.index)]
        assert sum(e < 4 for e in ids) == 2
        assert torch.equal(new.correction_bias, old.correction_bias[ids])
    with pytest.raises(ValueError, match="reachable"):
        prune_experts(teacher, calibration, keep=4, top_k=4, score="sf", group_balanced=True)


def test_small_dense_all_experts_equals_model_with_top_k_n():
    teacher, calibration = _teacher("qwen3_moe")
    reference = build_tiny("qwen3_moe", num_experts_per_tok=8).eval()  # same seed, same weights
    pruned = prune_experts(teacher, calibration, keep=8, top_k=8)
    assert torch.equal(_logits(pruned), _logits(reference))


def test_inference_reduce_sets_top_k_and_keeps_all_experts():
    teacher, calibration = _teacher("deepseek_v2")
    reduced = prune_experts(teacher, calibration, top_k=1)
    reference = build_tiny("deepseek_v2", num_experts_per_tok=1).eval()
    assert reduced.config.n_routed_experts == 8 and torch.equal(_logits(reduced), _logits(reference))


def test_condensers_are_always_kept(tmp_path):
    teacher, calibration = _teacher("olmoe")
    from moe_lab.compress.scores import scores

    es = scores(calibration, "es_act")
    worst = {i: torch.sort(s, stable=True).indices[:2].tolist() for i, s in es.items()}
    (tmp_path / "condenser.json").write_text(json.dumps(
        {"model_type": "olmoe", "layers": {str(i): {"bias": [0.0] * 8, "forced_experts": ids}
                                           for i, ids in worst.items()}}))
    pruned = prune_experts(teacher, calibration, keep=3, top_k=2, always_keep=tmp_path)
    for i, ids in worst.items():
        kept = pruned.moe_lab_manifest["layers"][str(i)]
        assert set(ids) <= set(kept) and len(kept) == 3


def test_bad_input_names_the_fix():
    teacher, calibration = _teacher("mixtral")
    with pytest.raises(ValueError, match=r"top_k=5 \(k', prune.top_k\) must be between 1 and keep=4"):
        prune_experts(teacher, calibration, keep=4, top_k=5)
    with pytest.raises(ValueError, match="keep=9"):
        prune_experts(teacher, calibration, keep=9)
    with pytest.raises(ValueError, match="needs a calibration"):
        prune_experts(teacher, None, keep=4)
    with pytest.raises(ValueError, match="always routes 2 experts"):
        prune_experts(_teacher("phimoe")[0], None, top_k=1)
    assert strategy_counts("small_dense", 8, 2, n_keep=4) == (4, 4)
    assert strategy_counts("small_moe", 8, 2, n_keep=4) == (4, 2)
    assert strategy_counts("inference_reduce", 8, 2, k_keep=1) == (8, 1)
    with pytest.raises(ValueError, match="prune.strategy='x'"):
        strategy_counts("x", 8, 2)
