"""MoE -> dense conversion (spec 2.8, oracle tests 2.15-1/2/3/4/5/16): block concatenation, padding,
per-token and whole-model MoE equivalence, copied parameters, vanilla reload, bad input."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from moe_lab.compress import calibrate
from moe_lab.compress.dense import DenseBuilder, LayerPlan, export_compressed, to_dense
from moe_lab.compress.grouping import GROUPINGS
from moe_lab.moe.experts import expert_forward
from moe_lab.moe.registry import FAMILIES
from moe_lab.moe.routing import router_logits, select_topk
from moe_lab.moe.view import find_moe_layers
from tests.conftest import ADDED_FAMILIES, assert_same_weights, build_tiny, random_batch, rehomed

DENSE_FAMILIES = ["olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "mixtral"]
# + every added family with a dense target, under -m slow (suite time)
DENSE_PARAMS = DENSE_FAMILIES + [pytest.param(f, marks=pytest.mark.slow) for f in ADDED_FAMILIES
                                 if FAMILIES[f].dense_target is not None]
# fp32 tolerance for sums of ~k*I products of O(1) terms computed in a different order
ATOL = 64 * torch.finfo(torch.float32).eps


@functools.cache
def _teacher(family: str, **overrides):
    model = build_tiny(family, **overrides).eval()
    return model, calibrate(model, [random_batch()])


def _logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _block_out(module, x):
    out = module(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


@pytest.mark.parametrize("family", DENSE_PARAMS)
def test_block_concatenation_equals_sum_of_scaled_representatives(family):
    """Dense FFN == shared(x) + sum_g alpha_g f_g(x) for random singleton plans and random alpha (test 1),
    and the block order does not matter (test 2)."""
    teacher, _ = _teacher(family)
    builder = DenseBuilder(teacher)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, teacher.config.hidden_size, generator=gen)
    plans = {}
    for view in builder.views:
        chosen = torch.randperm(view.num_experts, generator=gen)[: view.top_k].tolist()
        alpha = torch.rand(view.top_k, generator=gen, dtype=torch.float64) + 0.1
        plans[view.index] = LayerPlan(view.index, chosen, [[e] for e in chosen],
                                      [torch.ones(1, dtype=torch.float64)] * view.top_k, alpha)
    student = builder.write(plans)
    with torch.no_grad():
        for view in builder.views:
            p = plans[view.index]
            want = sum(float(a) * expert_forward(view, e, x) for e, a in zip(p.selected, p.alpha))
            if view.shared is not None:
                shared = view.shared(x)
                if view.shared_gate is not None:
                    shared = torch.sigmoid(view.shared_gate(x)) * shared
                want = want + shared
            module = student.get_submodule(view.name)
            got = torch.stack([_block_out(module, xi[None])[0] for xi in x])
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL * float(want.abs().max() + 1))
            # permuted block order: same output
            perm = LayerPlan(p.layer, p.selected[::-1], p.groups[::-1], p.coefficients, p.alpha.flip(0))
            builder.write({**plans, view.index: perm})
            torch.testing.assert_close(torch.stack([_block_out(module, xi[None])[0] for xi in x]), got,
                                       rtol=0, atol=ATOL * float(want.abs().max() + 1))
            builder.write(plans)


@pytest.mark.parametrize("family", DENSE_PARAMS)
def test_per_token_moe_equivalence(family):
    """K = k, S = S(t0), alpha = w(t0): the dense FFN on x(t0) equals the MoE block on x(t0) (test 5)."""
    teacher, _ = _teacher(family)
    builder = DenseBuilder(teacher)
    gen = torch.Generator().manual_seed(1)
    for view in builder.views:
        for _ in range(3):
            x0 = torch.randn(1, teacher.config.hidden_size, generator=gen)
            logits = router_logits(view.rule, x0, view.router_weight, view.router_bias)
            weights, idx = select_topk(view.rule, logits, False, correction_bias=view.correction_bias)
            chosen = idx[0].tolist()
            plan = LayerPlan(view.index, chosen, [[e] for e in chosen], [torch.ones(1, dtype=torch.float64)] * len(chosen),
                             weights[0].double())
            student = builder.write({**{v.index: plan for v in builder.views}, view.index: plan})
            with torch.no_grad():
                want = _block_out(view.block, x0)
                got = _block_out(student.get_submodule(view.name), x0)
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL * float(want.abs().max() + 1))


@pytest.mark.parametrize("family", DENSE_PARAMS)
def test_all_experts_zero_router_whole_model_equals_moe(family):
    """k = E and a zero router (every weight 1/E): the uniform-scaling student's logits equal the MoE's."""
    extra = {"deepseek_v3": {"routed_scaling_factor": 1.0, "topk_group": 2}}.get(family, {})
    teacher = build_tiny(family, num_experts_per_tok=8, **extra).eval()
    with torch.no_grad():
        for view in find_moe_layers(teacher):
            for p in view.router.parameters():
                p.zero_()
    batch = random_batch()
    calibration = calibrate(teacher, [batch])
    student = to_dense(teacher, calibration, score="sf", grouping="rr", scaling="uniform", K=8)
    want = _logits(teacher, batch)
    torch.testing.assert_close(_logits(student, batch), want, rtol=0, atol=ATOL * float(want.abs().max()))


@pytest.mark.parametrize("family", DENSE_PARAMS)
def test_copied_parameters_and_vanilla_reload(family, tmp_path):
    """Embeddings, attention, norms, lm_head bit-identical (test 16); the export reloads in vanilla
    transformers with identical weights and, in aligned memory, identical logits; the manifest records the plan."""
    teacher, calibration = _teacher(family)
    student = to_dense(teacher, calibration, score="acp", grouping="oc", scaling="proportional", K=4)
    moe = [v.name + "." for v in find_moe_layers(teacher)]
    source = teacher.state_dict()
    copied = 0
    for name, tensor in student.state_dict().items():
        if name in source and not any(name.startswith(p) for p in moe) and source[name].shape == tensor.shape:
            assert torch.equal(tensor, source[name]), name
            copied += 1
    assert copied >= 5 and "lm_head.weight" in student.state_dict()
    export_compressed(student, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert_same_weights(reloaded, student)
    batch = random_batch()
    assert torch.equal(_logits(rehomed(reloaded), batch), _logits(student, batch))
    info = student.moe_lab_manifest
    assert info["K"] == 4 and set(info["layers"]) == {str(v.index) for v in find_moe_layers(teacher)}
    assert all(len(layer["groups"]) == teacher.config.num_experts_per_tok for layer in info["layers"].values())
    assert (tmp_path / "compress_manifest.json").is_file()
    if teacher.config.model_type in ("olmoe", "qwen2_moe", "gpt_oss"):  # one-expert targets
        assert [v.num_experts for v in find_moe_layers(reloaded)] == [1] * len(find_moe_layers(teacher))


def test_grouping_is_irrelevant_at_K_equal_k():
    """K = k: the five groupings give singleton groups and identical students (test 4)."""
    teacher, calibration = _teacher("qwen3_moe")
    batch = random_batch()
    for score in ("sf", "do_acp"):
        for scaling in ("uniform", "proportional"):
            outs = [_logits(to_dense(teacher, calibration, score=score, grouping=g, scaling=scaling), batch)
                    for g in GROUPINGS]
            for out in outs[1:]:
                torch.testing.assert_close(out, outs[0], rtol=0, atol=ATOL * float(outs[0].abs().max()))


def test_dense_layers_are_zero_padded_and_stay_zero_under_adamw():
    """Teacher dense layers are copied into the wider student FFN with zero padding (test 3)."""
    teacher, calibration = _teacher("deepseek_v2")
    student = to_dense(teacher, calibration, score="cp", grouping="rr", scaling="conditional", K=2)
    src, dst = teacher.model.layers[0].mlp, student.model.layers[0].mlp
    width = src.gate_proj.weight.shape[0]
    assert dst.gate_proj.weight.shape[0] == student.config.intermediate_size > width
    x = torch.randn(4, teacher.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(dst(x), src(x), rtol=0, atol=ATOL * float(src(x).abs().max()))
    opt = torch.optim.AdamW(dst.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        dst(torch.randn(4, teacher.config.hidden_size)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert not dst.gate_proj.weight[width:].any() and not dst.up_proj.weight[width:].any()
    assert not dst.down_proj.weight[:, width:].any()


def test_dense_width_and_target_classes():
    for family, cls, width in (("qwen3_moe", "Qwen3ForCausalLM", 2 * 32), ("deepseek_v2", "DeepseekV2ForCausalLM",
                               (2 + 2) * 32), ("mixtral", "MistralForCausalLM", 2 * 32)):
        teacher, _ = _teacher(family)
        builder = DenseBuilder(teacher)
        assert type(builder.student).__name__ == cls and builder.width == width


def test_bad_input_names_the_fix():
    teacher, calibration = _teacher("qwen3_moe")
    with pytest.raises(ValueError, match=r"compress.K=1 must be between the router's top_k=2"):
        to_dense(teacher, calibration, K=1)
    with pytest.raises(ValueError, match=r"compress.K=9 .* set compress.K in \[2, 8\]"):
        to_dense(teacher, calibration, K=9)
    with pytest.raises(ValueError, match="compress.grouping='x'"):
        to_dense(teacher, calibration, grouping="x", K=4)
    phimoe = build_tiny("phimoe").eval()
    with pytest.raises(ValueError, match="phimoe.*no vanilla dense target"):
        DenseBuilder(phimoe)


def test_scaling_matches_the_routed_mass_of_a_renormalising_router():
    """DeepSeek-V3 (renormalised top-k, routed_scaling_factor 2.5): uniform alpha = 2.5 / k each, proportional
    alphas = 2.5 x S_g / sum S (hand, from the manifest's groups and the SF score) - both sum to the router's
    routed mass 2.5; conditional is refused for renormalising routers (DeepSeek-V3, Qwen3, GPT-OSS) naming
    the reason, and stays legal for DeepSeek-V2 (no renormalisation)."""
    from moe_lab.compress.scores import scores

    teacher, calibration = _teacher("deepseek_v3")
    k = teacher.config.num_experts_per_tok
    assert teacher.config.routed_scaling_factor == 2.5 and teacher.config.norm_topk_prob
    uni = to_dense(teacher, calibration, score="sf", grouping="rr", scaling="uniform", K=4).moe_lab_manifest
    assert uni["routed_scaling"] == 2.5
    for layer in uni["layers"].values():
        assert layer["alpha"] == [2.5 / k] * k
    prop = to_dense(teacher, calibration, score="sf", grouping="rr", scaling="proportional", K=4).moe_lab_manifest
    sf = scores(calibration, "sf")
    for index, layer in prop["layers"].items():
        s = sf[int(index)]
        mass = [float(sum(s[e] for e in g)) for g in layer["groups"]]
        want = [2.5 * m / sum(mass) for m in mass]
        assert layer["alpha"] == pytest.approx(want, rel=1e-12) and sum(layer["alpha"]) == pytest.approx(2.5)
    for family in ("deepseek_v3", "qwen3_moe", "gpt_oss"):
        model, cal = _teacher(family)
        with pytest.raises(ValueError, match="compress.scaling=conditional is for routers that do not renormalise"):
            to_dense(model, cal, score="sf", scaling="conditional")
    teacher, calibration = _teacher("deepseek_v2")
    student = to_dense(teacher, calibration, score="sf", scaling="conditional")
    cp = scores(calibration, "cp")
    scale = teacher.config.routed_scaling_factor
    for index, layer in student.moe_lab_manifest["layers"].items():
        assert layer["alpha"] == pytest.approx([scale * float(cp[int(index)][g[0]]) for g in layer["groups"]])
