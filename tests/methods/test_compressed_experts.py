"""Compressed Experts against independent oracles: top-k_main routing at initialisation (a per-token loop
over expert_forward on the HF router's weights), auxiliary experts never executed, vector gradients
against a hand-written per-token autograd oracle, exact export/load round trip, run.py end to end."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import transformers

import moe_lab
from moe_lab.methods.compressed_experts import (
    CONFIG_FILE,
    VECTORS_FILE,
    flop_ratio,
    load_compressed_experts,
)
from moe_lab.moe.block import ConventionalRouting, sparse_mixture
from moe_lab.moe.experts import expert_forward, expert_intermediate_size
from moe_lab.moe.view import find_moe_layers
from tests.conftest import build_tiny, method_families, random_batch, tiny_model_cfg
from tests.test_run import run_py

RTOL, ATOL = 1e-4, 1e-5  # fp32; the auxiliary average of ones is 1 up to rounding


def _tiny(family: str, top_k: int = 4):
    """Tiny model with 4 experts per token (2 main + 2 auxiliary), except phimoe (sparsemixer is top-2); the top-k
    is set under the name the tiny config gives it (num_experts_per_token: Kimi-Linear, moe_topk: Hunyuan,
    ffn_config.moe_top_k: DBRX)."""
    if family == "phimoe":
        return build_tiny(family)
    named = tiny_model_cfg(family).config
    if "ffn_config" in named:  # DBRX: ffn_config.moe_top_k
        return build_tiny(family, ffn_config={**named.ffn_config, "moe_top_k": top_k})
    field = next((k for k in ("num_experts_per_token", "moe_topk") if k in named), "num_experts_per_tok")
    return build_tiny(family, **{field: top_k})


def _oracle_hook(view, k_main: int, renormalize_main: bool = False):
    """A forward hook for an HF block's ``experts`` that replaces their mixture by the sum over the k_main
    largest of the weights HF's router passed them of w * E(x), E run by ``expert_forward`` on each expert's tokens.
    The HF block around them adds everything else (shared experts and their gates, output scaling, norms)."""

    def hook(module, args, output):
        x, indices, weights = args
        flat = x.reshape(-1, x.shape[-1])
        slots = weights.argsort(dim=1, descending=True, stable=True)[:, :k_main]
        main_w, main_i = weights.gather(1, slots), indices.gather(1, slots)
        if renormalize_main:
            main_w = main_w * (weights.sum(1, keepdim=True) / main_w.sum(1, keepdim=True))
        out = torch.zeros_like(flat)
        for e in main_i.unique().tolist():
            rows, cols = (main_i == e).nonzero(as_tuple=True)
            out[rows] += main_w[rows, cols, None] * expert_forward(view, e, flat[rows])  # rows: each token once
        return out.reshape(output.shape).to(output.dtype)

    return hook


DEFINED, REFUSED = method_families("compressed_experts")


@pytest.mark.parametrize("family", DEFINED)
def test_initial_output_equals_top_k_main_routing(family):
    """At initialisation (vectors = 1) the model equals top-k_main routing with the family's own top-k
    weights, not renormalised, on every supported family: olmoe (softmax), qwen3_moe (weights renormalised
    over the full top-k by the family, then kept), qwen2_moe (shared expert added unchanged by HF's block),
    blocks that scale or normalise their output (HF's block does it around the hooked experts), ..."""
    vanilla = _tiny(family).eval()
    ours = copy.deepcopy(vanilla)
    k_main = 2 if family != "phimoe" else 1
    patch = moe_lab.apply(ours, "compressed_experts")
    assert [view.router.moe_lab_policy.k_main for view in patch.views] == [k_main] * len(patch.layers)
    handles = [view.experts.register_forward_hook(_oracle_hook(view, k_main)) for view in find_moe_layers(vanilla)]
    batch = random_batch()
    with torch.no_grad():
        expected = vanilla(**batch).logits
        got = ours(**batch).logits
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        full_top_k = vanilla(**batch).logits
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert (got - full_top_k).abs().max() > 1e-3, "the oracle must differ from plain top-k routing"


def test_renormalized_main_weights_equal_hf_top_k_main_on_qwen3():
    """qwen3_moe renormalises its top-k weights; main_weights='renormalized' rescales the main experts to
    the whole top-k mass, which is exactly HF qwen3 with num_experts_per_tok=k_main (and the loop oracle)."""
    ours = _tiny("qwen3_moe").eval()
    moe_lab.apply(ours, "compressed_experts", main_weights="renormalized")
    hf_k2 = build_tiny("qwen3_moe", num_experts_per_tok=2).eval()  # same seed -> same weights
    loop = _tiny("qwen3_moe").eval()
    for view in find_moe_layers(loop):
        view.experts.register_forward_hook(_oracle_hook(view, 2, renormalize_main=True))
    batch = random_batch()
    with torch.no_grad():
        got, hf, oracle = ours(**batch).logits, hf_k2(**batch).logits, loop(**batch).logits
    torch.testing.assert_close(got, hf, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got, oracle, rtol=RTOL, atol=ATOL)


def _hf_top_k(model, batch, k_main):
    """Per MoE layer of an unpatched copy: HF's own router (weights, ids), ranked by weight and split into
    (main ids [N, k_main], auxiliary ids [N, k - k_main]) over the batch's tokens."""
    vanilla = copy.deepcopy(model)
    captured = {}
    for view in find_moe_layers(vanilla):
        view.router.register_forward_hook(
            lambda m, a, out, i=view.index: captured.__setitem__(i, (out[1].detach(), out[2].detach())))
    with torch.no_grad():
        vanilla(**batch)
    result = {}
    for index, (weights, indices) in captured.items():
        ranked = indices.gather(1, weights.argsort(dim=-1, descending=True, stable=True))
        result[index] = (ranked[:, :k_main], ranked[:, k_main:])
    return result


def _routing(model, patch, batch):
    """Per MoE layer: (main expert ids, auxiliary expert ids) over the batch's tokens (HF's router, split)."""
    k_main = patch.views[0].router.moe_lab_policy.k_main
    with patch.removed():
        split = _hf_top_k(model, batch, k_main)
    return {i: (set(main.flatten().tolist()), set(aux.flatten().tolist())) for i, (main, aux) in split.items()}


def test_auxiliary_experts_are_never_executed():
    """Experts that are auxiliary for every token they serve get NaN weights: the output stays finite and
    unchanged and their slices get exactly zero gradient (conventional routing over the same NaN weights
    turns the output into NaN, so the check can fail)."""
    model = _tiny("olmoe").train()
    patch = moe_lab.apply(model, "compressed_experts")
    batch = random_batch(batch=2, seq=6, pad_rows=())
    routing = _routing(model, patch, batch)
    aux_only = {i: sorted(aux - main) for i, (main, aux) in routing.items()}
    assert any(aux_only.values()), "precondition: some expert serves only as auxiliary in this batch"
    torch.manual_seed(0)
    reference = model(**batch).logits.detach()
    with torch.no_grad():
        for view in patch.views:
            for e in aux_only[view.index]:
                view.gate_up_proj[e] = float("nan")
                view.down_proj[e] = float("nan")
    out = model(**batch)
    assert torch.equal(out.logits, reference)
    out.loss.backward()
    for view, layer in zip(patch.views, patch.layers):
        for e in aux_only[view.index]:
            assert torch.equal(view.gate_up_proj.grad[e], torch.zeros_like(view.gate_up_proj[e]))
            assert torch.equal(view.down_proj.grad[e], torch.zeros_like(view.down_proj[e]))
            assert layer.compressed_experts.input_scale[e].grad.abs().sum() > 0
    for view, layer in zip(patch.views, patch.layers):  # conventional routing and mixing
        view.router.moe_lab_policy = ConventionalRouting(view)
        layer.mixer = sparse_mixture
    with torch.no_grad():
        assert torch.isnan(model(**batch).logits).any()


def _hand_expert(view, e, x_gate, x_up, family):
    """One expert on one token, written out per layout (gate/up inputs may differ)."""
    if family == "gpt_oss":  # [H, 2I] interleaved gate/up columns with biases, clamped SwiGLU
        w, b, experts = view.gate_up_proj[e], view.experts.gate_up_proj_bias[e], view.experts
        gate = (x_gate @ w[:, 0::2] + b[0::2]).clamp(max=experts.limit)
        up = (x_up @ w[:, 1::2] + b[1::2]).clamp(-experts.limit, experts.limit)
        return (up + 1) * gate * torch.sigmoid(gate * experts.alpha), \
            lambda h: h @ view.down_proj[e] + view.experts.down_proj_bias[e]
    if family == "dbrx":  # expert e owns rows e*I .. (e+1)*I-1 of w1 (gate), v1 (up), w2 (down, applied as h @ W)
        mlp, size = view.experts.mlp, view.experts.ffn_hidden_size
        w1, v1, w2 = (w[e * size:(e + 1) * size] for w in (mlp.w1, mlp.v1, mlp.w2))
        return torch.nn.functional.silu(w1 @ x_gate) * (v1 @ x_up), lambda h: h @ w2
    size = view.down_proj.shape[2]  # [2I, H]: gate rows then up rows, SiLU
    gate, up = view.gate_up_proj[e][:size] @ x_gate, view.gate_up_proj[e][size:] @ x_up
    return torch.nn.functional.silu(gate) * up, lambda h: view.down_proj[e] @ h


def _hand_block(view, x, vectors, k_main, three, family):
    """Per-token Compressed Experts layer output written out by hand (olmoe or gpt_oss routing); ``three``:
    gate-input, up-input and intermediate vectors, else one input vector."""
    router = view.router
    if family == "gpt_oss":  # top-k on the biased logits, softmax over the selected ones
        top_logits, top_i = (x @ router.weight.T + router.bias).topk(view.top_k, dim=-1)
        top_w = torch.softmax(top_logits, dim=-1)
    elif family == "dbrx":  # softmax top-k divided by the top-k's 1-norm (moe_normalize_expert_weights=1)
        top_w, top_i = torch.softmax(x @ router.layer.weight.T, dim=-1).topk(view.top_k, dim=-1)
        top_w = top_w / top_w.abs().sum(dim=-1, keepdim=True)
    else:
        top_w, top_i = torch.softmax(x @ router.weight.T, dim=-1).topk(view.top_k, dim=-1)
    rows = []
    for t in range(x.shape[0]):
        main = [(top_w[t, j], int(top_i[t, j])) for j in range(k_main)]
        aux = [(top_w[t, j], int(top_i[t, j])) for j in range(k_main, view.top_k)]
        total = sum(w for w, _ in aux)
        u = sum(w / total * vectors["input_scale"][e] for w, e in aux)
        s = sum(w / total * vectors["act_scale"][e] for w, e in aux) if three else 1.0
        u_up = sum(w / total * vectors["up_input_scale"][e] for w, e in aux) if three else u
        y = torch.zeros_like(x[t])
        for w, e in main:
            hidden, down = _hand_expert(view, e, x[t] * u, x[t] * u_up, family)
            y = y + w * down(hidden * s)
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", pytest.param("dbrx", marks=pytest.mark.slow)])
@pytest.mark.parametrize("form", ["input", "gate_up_intermediate"])
def test_layer_and_vector_gradients_match_a_hand_written_oracle(form, family):
    """Non-trivial vectors: the layer output and the gradients of vectors, input and expert weights equal
    autograd through a per-token formula written out by hand (2 main + 2 auxiliary experts; concatenated
    SiLU experts, GPT-OSS's interleaved, biased, clamped ones and DBRX's w1 / v1 / w2 rows), for both forms: one input vector per
    expert (H parameters) and gate-input / up-input / intermediate vectors (2H + I)."""
    model = _tiny(family)
    patch = moe_lab.apply(model, "compressed_experts", form=form)
    sizes = {k: v.shape for k, v in patch.layers[0].compressed_experts.stacked().items()}
    hidden, inter = model.config.hidden_size, expert_intermediate_size(patch.views[0])
    assert sizes == ({"input_scale": (8, hidden)} if form == "input" else
                     {"input_scale": (8, hidden), "up_input_scale": (8, hidden), "act_scale": (8, inter)})
    view, block = patch.views[0], patch.layers[0]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in block.compressed_experts.parameters():
            param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
    x = torch.randn(2, 9, model.config.hidden_size, generator=gen, requires_grad=True)
    upstream = torch.randn(2, 9, model.config.hidden_size, generator=gen)
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    (out * upstream).sum().backward()
    expert_params = dict(view.expert_module.named_parameters(recurse=False))  # the tensors, not [E, ...] views
    ours = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in expert_params.items()},
            "vectors": {k: torch.stack([p.grad for p in getattr(block.compressed_experts, k)])
                        for k in block.compressed_experts.stacked()}}

    x2 = x.detach().clone().requires_grad_(True)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in block.compressed_experts.stacked().items()}
    for param in expert_params.values():
        param.grad = None
    y = _hand_block(view, x2.reshape(-1, x2.shape[-1]), leaves, 2, form == "gate_up_intermediate", family)
    torch.testing.assert_close(out.detach().reshape(-1, x.shape[-1]), y.detach(), rtol=RTOL, atol=ATOL)
    (y * upstream.reshape(-1, x.shape[-1])).sum().backward()
    torch.testing.assert_close(ours["x"], x2.grad, rtol=1e-4, atol=1e-5)
    for name, param in expert_params.items():
        torch.testing.assert_close(ours[name], param.grad, rtol=1e-4, atol=1e-5, msg=name)
    for kind, grad in ours["vectors"].items():
        assert grad.abs().sum() > 0, kind
        torch.testing.assert_close(grad, leaves[kind].grad, rtol=1e-4, atol=1e-5, msg=kind)


def test_vectors_only_training_freezes_the_model():
    model = _tiny("qwen2_moe")
    patch = moe_lab.apply(model, "compressed_experts", full_finetune=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".compressed_experts." in n for n in trainable)
    assert len(trainable) == 8 * len(patch.layers)  # one input vector per expert and layer (the default form)
    model.train()
    model(**random_batch()).loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)


def test_export_writes_vanilla_weights_and_the_vectors_load_back_exactly(tmp_path, caplog):
    model = _tiny("qwen2_moe")
    original = copy.deepcopy(model).eval()
    patch = moe_lab.apply(model, "compressed_experts", form="gate_up_intermediate")
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=gen))
    model.eval()
    batch = random_batch()
    with torch.no_grad():
        ours = model(**batch).logits
    patch.export(tmp_path / "export")
    assert "cannot represent" in caplog.text
    config = json.loads((tmp_path / "export" / CONFIG_FILE).read_text())
    assert config["options"] == {"k_main": 2, "full_finetune": True, "form": "gate_up_intermediate",
                                 "main_weights": "original"}
    assert "cannot represent" in config["note"] and (tmp_path / "export" / VECTORS_FILE).exists()

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        vanilla = reloaded(**batch).logits
        hf = original(**batch).logits
    assert (vanilla - ours).abs().max() > 1e-3  # vanilla HF routes to the full top-k
    assert (vanilla - hf).abs().max() > 1e-4  # ... with the fine-tuned weights
    loaded = load_compressed_experts(reloaded, tmp_path / "export")
    assert loaded.method == "compressed_experts"
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, ours)


def test_load_rejects_a_directory_without_vectors(tmp_path):
    model = _tiny("olmoe")
    moe_lab.apply(model, "sft").export(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="not exported from a compressed_experts run"):
        load_compressed_experts(_tiny("olmoe"), tmp_path / "plain")


@pytest.mark.parametrize("options,message", [
    ({"k_main": 4}, r"method.options.k_main=4 must be an integer in \[1, 3\]"),
    ({"k_main": 0}, r"method.options.k_main=0"),
    ({"k_main": 1.5}, r"method.options.k_main=1.5"),
    ({"form": "separate"}, "method.options.form='separate'"),
    ({"main_weights": "softmax"}, "method.options.main_weights='softmax'"),
])
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        moe_lab.apply(_tiny("olmoe"), "compressed_experts", **options)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_by_name_where_undefined(family):
    with pytest.raises(ValueError, match=re.escape(f"compressed_experts is not defined for {family}: {REFUSED[family]}")):
        moe_lab.apply(_tiny(family), "compressed_experts")


def test_top_1_models_are_rejected():
    with pytest.raises(ValueError, match="needs top_k >= 2"):
        moe_lab.apply(build_tiny("olmoe", num_experts_per_tok=1), "compressed_experts")


@pytest.mark.parametrize("form", ["input", "gate_up_intermediate"])
def test_flop_ratio_counts_main_experts_only(form):
    patch = moe_lab.apply(_tiny("olmoe"), "compressed_experts", form=form)
    model = patch.model
    embed = model.get_input_embeddings().weight.numel()
    routed = sum(p.numel() for v in patch.views for p in v.experts.parameters())
    vectors = sum(p.numel() for b in patch.layers for p in b.compressed_experts.parameters())
    dense = sum(p.numel() for p in model.parameters()) - embed - routed - vectors
    per_layer_expert = routed // len(patch.views) // 8
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    size = hidden if form == "input" else 2 * hidden + inter
    sft = dense + 4 * per_layer_expert * len(patch.views)
    ce = dense + 2 * per_layer_expert * len(patch.views) + len(patch.views) * (8 + 1) * size
    assert flop_ratio(patch) == pytest.approx(ce / sft, rel=1e-12)


@pytest.mark.slow
def test_run_py_compressed_experts_exports_the_vectors(tmp_path):
    out = tmp_path / "run"
    run_py("method=compressed_experts", "model=tiny_olmoe", "debug=fast", f"hydra.run.dir={out}", cwd=tmp_path)
    assert (out / "export" / VECTORS_FILE).exists() and (out / "export" / CONFIG_FILE).exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "export")
    patch = load_compressed_experts(model, out / "export")
    trained = patch.layers[0].compressed_experts.input_scale[0]
    assert trained.shape == (model.config.hidden_size,)
    assert any(not torch.equal(p, torch.ones_like(p)) for b in patch.layers for p in b.compressed_experts.parameters())


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss"])
def test_only_main_experts_count_as_load(family):
    """Routing counts (expert-load statistics) count the k_main experts that run, per real token: equal to
    the bincount over non-pad tokens of the main experts of HF's own top-k (HF's router class run on the
    tokens entering each layer, ranked by weight)."""
    model = _tiny(family).train()
    patch = moe_lab.apply(model, "compressed_experts")
    batch = random_batch()
    real = batch["attention_mask"].reshape(-1).bool()
    inputs = {}
    for view in patch.views:
        view.router.register_forward_pre_hook(lambda m, a, i=view.index: inputs.__setitem__(i, a[0].detach()))
    model(**batch)
    counts = patch.counts()
    for row, view in enumerate(patch.views):
        router = view.router
        with torch.no_grad():
            _, weights, ids = type(router).__mro__[1].forward(router, inputs[view.index])  # the HF class
        ranked = ids.gather(1, weights.argsort(dim=-1, descending=True, stable=True))
        expected = torch.bincount(ranked[:, :2][real].flatten(), minlength=view.num_experts)
        assert torch.equal(counts[row], expected), view.index
        assert int(counts[row].sum()) == 2 * int(real.sum())
        with_aux = expected + torch.bincount(ranked[:, 2:][real].flatten(), minlength=view.num_experts)
        assert not torch.equal(counts[row], with_aux)


# top-1 PhiMoE (the paper's "Top-k/2 SFT" baseline for Phi-3.5-MoE, k 2 -> 1) ----------------------------
def test_hf_sparsemixer_ignores_top_k_so_moe_lab_implements_top_1():
    """HF's PhimoeTopKRouter passes top_k to sparsemixer, which ignores it and always returns 2 experts; our
    top-1 sparsemixer is its first-expert stage: same ids, weights and logit gradients (Heun's third-order
    multiplier) as the first column of HF's output, at the same seed, in training (Gumbel sampling) and eval."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from moe_lab.moe.routing import RoutingRule, select_topk

    hf = build_tiny("phimoe", num_experts_per_tok=1)
    router = find_moe_layers(hf)[0].router
    assert router.top_k == 1 and router(torch.randn(5, hf.config.hidden_size))[2].shape == (5, 2)
    rule = RoutingRule(score="sparsemixer", top_k=1, num_experts=8, jitter_eps=0.01, weights_in_logits_dtype=False)
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(64, 1, generator=torch.Generator().manual_seed(1))
    for training in (True, False):
        ours, theirs = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        torch.manual_seed(3)
        w1, i1 = select_topk(rule, ours, training)
        torch.manual_seed(3)
        w2, i2 = sparsemixer(theirs, jitter_eps=0.01, training=training)
        assert i1.shape == (64, 1) and torch.equal(i1, i2[:, :1]) and torch.equal(w1, w2[:, :1])
        (w1 * upstream).sum().backward()
        (w2[:, :1] * upstream).sum().backward()
        assert torch.equal(ours.grad, theirs.grad)
    with pytest.raises(ValueError, match="top_k 1 or 2, got 3"):
        RoutingRule(score="sparsemixer", top_k=3, num_experts=8)


def test_top_1_phimoe_matches_hf_first_expert_routing_and_trains():
    """A tiny PhiMoE with num_experts_per_tok=1 under moe-lab: eval logits equal vanilla HF's with every
    router's output cut to its first expert (HF's top-2 computes that column first, the same way); one
    AdamW step moves the router and only the experts that were routed."""
    vanilla = build_tiny("phimoe", num_experts_per_tok=1).eval()
    ours = copy.deepcopy(vanilla)
    patch = moe_lab.apply(ours, "sft")
    assert patch.layers[0].top_k == 1
    for view in find_moe_layers(vanilla):
        view.router.register_forward_hook(lambda m, a, out: (out[0], out[1][:, :1], out[2][:, :1]))
    batch = random_batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(**batch).logits, vanilla(**batch).logits, rtol=0, atol=0)
    ours.train()
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    loss = ours(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    optimizer.step()
    router = patch.views[0].router
    assert not torch.equal(router.weight, before[f"{patch.views[0].name}.router.weight"])
    counts = patch.counts()
    assert int(counts[0].sum()) == int(batch["attention_mask"].sum())  # one expert per real token
