"""Compressed Experts against independent oracles: top-k_main routing at initialisation (a per-token loop
over expert_forward on the HF router's weights), auxiliary experts never executed, vector gradients
against a hand-written per-token autograd oracle, exact export/load round trip, run.py end to end."""

from __future__ import annotations

import copy
import json

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
from moe_lab.moe.block import sparse_mixture
from moe_lab.moe.experts import expert_forward
from moe_lab.moe.view import find_moe_layers
from tests.conftest import FAMILIES, build_tiny, random_batch
from tests.test_run import run_py

RTOL, ATOL = 1e-4, 1e-5  # fp32; the auxiliary average of ones is 1 up to rounding


def _tiny(family: str, top_k: int = 4):
    """Tiny model with 4 experts per token (2 main + 2 auxiliary), except phimoe (sparsemixer is top-2)."""
    return build_tiny(family) if family == "phimoe" else build_tiny(family, num_experts_per_tok=top_k)


def _oracle_hook(view, k_main: int, renormalize_main: bool = False):
    """Replace an HF block's output by sum over the k_main largest HF-router weights of w * E(x)
    (+ the family's shared expert), one token at a time with ``expert_forward``."""

    def hook(module, args, output):
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = getattr(module, view.spec.router_attr)(flat)
        out = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            slots = sorted(range(weights.shape[1]), key=lambda j: -float(weights[t, j]))[:k_main]
            scale = float(weights[t].sum() / weights[t, slots].sum()) if renormalize_main else 1.0
            for j in slots:
                e = int(indices[t, j])
                out[t] += weights[t, j] * scale * expert_forward(view, e, flat[t:t + 1])[0]
        if view.shared is not None:
            shared = view.shared(flat)
            if view.shared_gate is not None:
                shared = torch.sigmoid(view.shared_gate(flat)) * shared
            out = out + shared
        out = out.reshape(x.shape)
        return (out, output[1]) if isinstance(output, tuple) else out

    return hook


@pytest.mark.parametrize("family", FAMILIES)
def test_initial_output_equals_top_k_main_routing(family):
    """At initialisation (vectors = 1) the model equals top-k_main routing with the family's own top-k
    weights, not renormalised: olmoe (softmax), qwen3_moe (weights renormalised over the full top-k by
    the family, then kept), qwen2_moe (shared expert added unchanged) and every other family."""
    vanilla = _tiny(family).eval()
    ours = copy.deepcopy(vanilla)
    k_main = 2 if family != "phimoe" else 1
    patch = moe_lab.apply(ours, "compressed_experts")
    assert [layer.mixer.k_main for layer in patch.layers] == [k_main] * len(patch.layers)
    handles = [view.block.register_forward_hook(_oracle_hook(view, k_main)) for view in find_moe_layers(vanilla)]
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
        view.block.register_forward_hook(_oracle_hook(view, 2, renormalize_main=True))
    batch = random_batch()
    with torch.no_grad():
        got, hf, oracle = ours(**batch).logits, hf_k2(**batch).logits, loop(**batch).logits
    torch.testing.assert_close(got, hf, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got, oracle, rtol=RTOL, atol=ATOL)


def _routing(model, patch, batch):
    """Per MoE layer: (main expert ids, auxiliary expert ids) over the batch's tokens, split here by weight."""
    captured = {}

    def capture(index):
        def hook(module, args, out):
            captured[index] = (out[1].detach(), out[2].detach())

        return hook

    handles = [view.router.register_forward_hook(capture(view.index)) for view in patch.views]
    with torch.no_grad():
        model(**batch)
    for handle in handles:
        handle.remove()
    result = {}
    for index, (weights, indices) in captured.items():
        order = weights.argsort(dim=-1, descending=True, stable=True)
        ranked = indices.gather(1, order)
        k_main = patch.layers[0].mixer.k_main
        result[index] = (set(ranked[:, :k_main].flatten().tolist()), set(ranked[:, k_main:].flatten().tolist()))
    return result


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
            assert layer.compressed_experts.act_scale[e].grad.abs().sum() > 0
    for layer in patch.layers:
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
    size = view.down_proj.shape[2]  # [2I, H]: gate rows then up rows, SiLU
    gate, up = view.gate_up_proj[e][:size] @ x_gate, view.gate_up_proj[e][size:] @ x_up
    return torch.nn.functional.silu(gate) * up, lambda h: view.down_proj[e] @ h


def _hand_block(view, x, vectors, k_main, separate, family):
    """Per-token Compressed Experts layer output written out by hand (olmoe or gpt_oss routing)."""
    router = view.router
    if family == "gpt_oss":  # top-k on the biased logits, softmax over the selected ones
        top_logits, top_i = (x @ router.weight.T + router.bias).topk(view.top_k, dim=-1)
        top_w = torch.softmax(top_logits, dim=-1)
    else:
        top_w, top_i = torch.softmax(x @ router.weight.T, dim=-1).topk(view.top_k, dim=-1)
    rows = []
    for t in range(x.shape[0]):
        main = [(top_w[t, j], int(top_i[t, j])) for j in range(k_main)]
        aux = [(top_w[t, j], int(top_i[t, j])) for j in range(k_main, view.top_k)]
        total = sum(w for w, _ in aux)
        u = sum(w / total * vectors["input_scale"][e] for w, e in aux)
        s = sum(w / total * vectors["act_scale"][e] for w, e in aux)
        u_up = sum(w / total * vectors["up_input_scale"][e] for w, e in aux) if separate else u
        y = torch.zeros_like(x[t])
        for w, e in main:
            hidden, down = _hand_expert(view, e, x[t] * u, x[t] * u_up, family)
            y = y + w * down(hidden * s)
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss"])
@pytest.mark.parametrize("input_scaling", ["shared", "separate"])
def test_layer_and_vector_gradients_match_a_hand_written_oracle(input_scaling, family):
    """Non-trivial vectors: the layer output and the gradients of vectors, input and expert weights equal
    autograd through a per-token formula written out by hand (2 main + 2 auxiliary experts; concatenated
    SiLU experts and GPT-OSS's interleaved, biased, clamped ones)."""
    model = _tiny(family)
    patch = moe_lab.apply(model, "compressed_experts", input_scaling=input_scaling)
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
    ours = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in view.expert_parameters().items()},
            "vectors": {k: torch.stack([p.grad for p in getattr(block.compressed_experts, k)])
                        for k in block.compressed_experts.stacked()}}

    x2 = x.detach().clone().requires_grad_(True)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in block.compressed_experts.stacked().items()}
    for param in view.expert_parameters().values():
        param.grad = None
    y = _hand_block(view, x2.reshape(-1, x2.shape[-1]), leaves, 2, input_scaling == "separate", family)
    torch.testing.assert_close(out.detach().reshape(-1, x.shape[-1]), y.detach(), rtol=RTOL, atol=ATOL)
    (y * upstream.reshape(-1, x.shape[-1])).sum().backward()
    torch.testing.assert_close(ours["x"], x2.grad, rtol=1e-4, atol=1e-5)
    for name, param in view.expert_parameters().items():
        torch.testing.assert_close(ours[name], param.grad, rtol=1e-4, atol=1e-5, msg=name)
    for kind, grad in ours["vectors"].items():
        assert grad.abs().sum() > 0, kind
        torch.testing.assert_close(grad, leaves[kind].grad, rtol=1e-4, atol=1e-5, msg=kind)


def test_vectors_only_training_freezes_the_model():
    model = _tiny("qwen2_moe")
    patch = moe_lab.apply(model, "compressed_experts", full_finetune=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".compressed_experts." in n for n in trainable)
    assert len(trainable) == 2 * 8 * len(patch.layers)  # input + activation vector per expert and layer
    model.train()
    model(**random_batch()).loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)


def test_export_writes_vanilla_weights_and_the_vectors_load_back_exactly(tmp_path, caplog):
    model = _tiny("qwen2_moe")
    original = copy.deepcopy(model).eval()
    patch = moe_lab.apply(model, "compressed_experts", input_scaling="separate")
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
    assert config["options"] == {"k_main": 2, "full_finetune": True, "input_scaling": "separate",
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
    ({"k_main": 4}, r"k_main=4 must be an integer in \[1, 3\]"),
    ({"k_main": 0}, r"k_main=0"),
    ({"input_scaling": "per_projection"}, "input_scaling='per_projection'"),
    ({"main_weights": "softmax"}, "main_weights='softmax'"),
])
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        moe_lab.apply(_tiny("olmoe"), "compressed_experts", **options)


def test_top_1_models_are_rejected():
    with pytest.raises(ValueError, match="needs top_k >= 2"):
        moe_lab.apply(build_tiny("olmoe", num_experts_per_tok=1), "compressed_experts")


def test_flop_ratio_counts_main_experts_only():
    patch = moe_lab.apply(_tiny("olmoe"), "compressed_experts")
    model = patch.model
    embed = model.get_input_embeddings().weight.numel()
    routed = sum(p.numel() for v in patch.views for p in v.experts.parameters())
    vectors = sum(p.numel() for b in patch.layers for p in b.compressed_experts.parameters())
    dense = sum(p.numel() for p in model.parameters()) - embed - routed - vectors
    per_layer_expert = routed // len(patch.views) // 8
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    sft = dense + 4 * per_layer_expert * len(patch.views)
    ce = dense + 2 * per_layer_expert * len(patch.views) + len(patch.views) * (8 + 1) * (hidden + inter)
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
