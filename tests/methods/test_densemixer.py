"""DenseMixer against a dense autograd oracle (docs/design.md, "Methods, precisely"), on every supported family it is
defined for; the others are refused by name."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import moe_lab
from moe_lab.methods.densemixer import dense_weights
from moe_lab.moe.experts import expert_intermediate_size
from tests.conftest import build_tiny, method_families, random_batch

DEFINED, REFUSED = method_families("densemixer")


def _hf_expert_output(experts, x, e):
    """Expert e on every token, computed by the HF packed-experts module itself (weight 1)."""
    n = x.shape[0]
    out = experts(x, torch.full((n, 1), e, dtype=torch.long), torch.ones(n, 1, dtype=x.dtype))
    return out.reshape(n, -1)  # DBRX's experts return [n, 1, H]


def _oracle_dense_weights(rule, logits, indices):
    """The dense weights written out from the routing rule's normalisation fields, independently of
    ``dense_weights``: w_e = scaling * num_e / norm with num the per-expert score (softmax over all logits,
    sigmoid, or exp of the logit for a softmax over the top-k) and norm the sum over the selected experts where
    the rule normalises the top-k (else 1); inactive experts see stopgrad(norm)."""
    assert rule.score in ("softmax", "sigmoid") or rule.softmax_over_topk, rule
    selected = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, True)
    lf = logits.float()
    if rule.softmax_over_topk:
        num = torch.exp(lf - lf.gather(1, indices).max(-1, keepdim=True).values.detach())
        norm = (num * selected).sum(-1, keepdim=True)
    else:
        num = torch.sigmoid(lf) if rule.score == "sigmoid" else torch.softmax(lf, dim=-1)
        norm = torch.ones_like(lf[:, :1])
        if rule.renormalize:  # the top-k sum, or their p-norm (DBRX's moe_normalize_expert_weights)
            top = num * selected
            norm = top.sum(-1, keepdim=True) if rule.renorm_p is None else top.norm(p=rule.renorm_p, dim=-1,
                                                                                      keepdim=True)
            norm = norm if rule.renorm_min is None else norm.clamp(min=rule.renorm_min)
            norm = norm + rule.renorm_eps
    return torch.where(selected, num / norm, num / norm.detach()) * rule.scaling


def _hf_block(patch):
    """A copy of the first vanilla HF block (own parameters) with its HF router class back; hooks record the
    router's (logits, weights, indices) and the experts' input and output (the routed mixture) in its forward."""
    view = patch.views[0]
    block = copy.deepcopy(view.block)
    router = getattr(block, patch.spec.router_attr)
    router.__class__ = type(router).__mro__[1]  # moe-lab's routed router subclasses the HF router class
    seen = {}

    def on_router(module, args, out):
        seen["route"] = tuple(t.reshape(-1, t.shape[-1]) for t in out) if isinstance(out, tuple) else out

    def on_experts(module, args, out):
        seen["x"], seen["mix"] = args[0].reshape(-1, args[0].shape[-1]), out  # DBRX passes [B, S, H]
        if isinstance(seen["route"], torch.Tensor):  # a router returning logits alone (DBRX): the block's top-k
            seen["route"] = (seen["route"], args[2], args[1])

    router.register_forward_hook(on_router)
    block.experts.register_forward_hook(on_experts)
    return block, seen


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def _expert_outputs(experts, x, num_experts):
    with torch.no_grad():
        return torch.stack([_hf_expert_output(experts, x, e) for e in range(num_experts)], dim=1)  # [N, E, H]


def _anchored_weights(view, route):
    """Oracle dense weights from HF's router outputs; at the selected experts they are HF's own weights."""
    logits, weights, indices = route
    w = _oracle_dense_weights(view.rule, logits, indices)
    torch.testing.assert_close(w.gather(1, indices).detach(), weights.detach().float(), rtol=1e-6, atol=1e-7)
    return w, indices


def _length(view, tokens):
    """Reductions per gradient / value entry: H and I per expert output, H for <g, E>, E experts, N tokens."""
    return 2 * view.config.hidden_size + expert_intermediate_size(view) + view.num_experts + tokens


# DBRX dividing its top-k by their 2-norm (moe_normalize_expert_weights=2): inactive experts see stopgrad(||s_topk||)
DBRX_P2 = {"ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2,
                          "moe_normalize_expert_weights": 2.0}}


@pytest.mark.parametrize("gradient", ["straight_through", "paper_eq15"])
@pytest.mark.parametrize("family,overrides", [*((f, {}) for f in DEFINED), pytest.param("dbrx", DBRX_P2, marks=pytest.mark.slow)],
                         ids=[*DEFINED, "dbrx-p2"])
def test_block_matches_dense_autograd_oracle(family, overrides, gradient):
    """Every family DenseMixer is defined for, both router-gradient estimators.

    Oracle: the surrogate loss <g, y_hf> + sum_(token, e) stopgrad(A_e) * w_e on HF's own block, with w the
    dense weights written out from the routing rule (anchored to HF's weights at the selected experts) and,
    with g_mix = d<g, y_hf>/d(the experts' mixture) (the block may scale, normalise or combine it),
    A = (1 - M_e) <g_mix, E_e(x)> (straight-through: every expert gets <g_mix, E_e(x)>, the selected ones through
    HF's own sparse path) or A = w_e <g_mix, E_e(x)> (Eq. 15: (w_e + M_e) <g_mix, E_e(x)>, the M_e part again
    through HF's path); E_e run by HF's packed experts."""
    vanilla = build_tiny(family, **overrides).train()
    ours = copy.deepcopy(vanilla)
    patch = moe_lab.apply(ours, "densemixer", gradient=gradient)
    block, view = patch.layers[0], patch.views[0]
    hf_block, seen = _hf_block(patch)

    gen = torch.Generator().manual_seed(3)
    hidden = vanilla.config.hidden_size
    x = torch.randn(2, 7, hidden, generator=gen)
    g = torch.randn(2, 7, hidden, generator=gen)

    # moe-lab DenseMixer
    x1 = x.clone().requires_grad_(True)
    y1 = _first(block(x1))
    (y1 * g).sum().backward()

    # oracle: <g, y_hf> + sum over (token, expert) of stopgrad(A) * w_dense on HF's block
    x2 = x.clone().requires_grad_(True)
    y2 = _first(hf_block(x2))
    w, indices = _anchored_weights(view, seen["route"])
    plain = (y2 * g).sum()
    (g_mix,) = torch.autograd.grad(plain, seen["mix"], retain_graph=True)
    flat = seen["x"].detach()
    contrib = (g_mix.reshape(-1, 1, hidden) * _expert_outputs(hf_block.experts, flat, view.num_experts)).sum(-1)
    inactive = torch.ones_like(w, dtype=torch.bool).scatter_(1, indices, False)
    coefficient = contrib * inactive if gradient == "straight_through" else contrib * w.detach()
    (plain + (w * coefficient).sum()).backward()

    assert torch.equal(y1, y2), "forward value must equal the conventional top-k output bit for bit"
    # same math, summed in another order: |difference| <= eps * (2H + I + E + N) * the largest gradient entry
    length = _length(view, flat.shape[0])

    def close(got, want, msg=""):
        tol = torch.finfo(torch.float32).eps * length * want.abs().max()
        assert (got - want).abs().max() <= tol, (msg, float((got - want).abs().max()), float(tol))

    close(x1.grad, x2.grad, "input")
    ours_params = dict(block.named_parameters())
    for name, q in hf_block.named_parameters():
        p = ours_params[name]
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        close(p.grad, q.grad, name)
    assert view.router_weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_by_name_where_undefined(family):
    with pytest.raises(ValueError, match=re.escape(f"densemixer is not defined for {family}: {REFUSED[family]}")):
        moe_lab.apply(build_tiny(family), "densemixer")


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_expert_gradients_equal_conventional_given_same_output_gradient(family):
    """With the same dL/dy at the layer, expert (and shared-expert) gradients are the conventional ones,
    while the router gradient differs (it now sees every expert)."""
    base = build_tiny(family).train()
    conv, dm = copy.deepcopy(base), copy.deepcopy(base)
    p_conv, p_dm = moe_lab.apply(conv, "sft"), moe_lab.apply(dm, "densemixer")
    x = torch.randn(3, 5, base.config.hidden_size, generator=torch.Generator().manual_seed(0))
    g = torch.randn_like(x)
    for patch in (p_conv, p_dm):
        (patch.layers[0](x) * g).sum().backward()
    a, b = dict(p_conv.layers[0].named_parameters()), dict(p_dm.layers[0].named_parameters())
    for name, param in a.items():
        if "experts" in name:
            assert torch.equal(param.grad, b[name].grad), name
    router = p_conv.spec.router_attr
    assert not torch.allclose(a[f"{router}.weight"].grad, b[f"{router}.weight"].grad)


def test_dense_weights_equal_conventional_weights_at_selected_experts(family):
    if family in REFUSED:
        pytest.skip(f"densemixer is not defined for {family}: {REFUSED[family]}")
    model = build_tiny(family)
    patch = moe_lab.apply(model, "sft")
    view = patch.views[0]
    x = torch.randn(11, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits, weights, indices = view.router(x)
    torch.testing.assert_close(dense_weights(view.rule, logits, indices).gather(1, indices), weights,
                               rtol=1e-6, atol=1e-7)


def test_model_loss_is_bit_identical_and_router_gets_more_gradient():
    base = build_tiny("qwen2_moe").train()
    conv, dm = copy.deepcopy(base), copy.deepcopy(base)
    moe_lab.apply(conv, "sft")
    moe_lab.apply(dm, "densemixer")
    batch = random_batch()
    out_c, out_d = conv(**batch), dm(**batch)
    assert torch.equal(out_c.logits, out_d.logits)
    out_c.loss.backward()
    out_d.loss.backward()
    # shared experts are untouched by DenseMixer: no straight-through term reaches them directly
    gc = conv.model.layers[0].mlp.gate.weight.grad
    gd = dm.model.layers[0].mlp.gate.weight.grad
    assert not torch.allclose(gc, gd)


def test_chunking_does_not_change_gradients():
    """One OLMoE block, fixed input x [N, H] and upstream g: the router-weight gradient with ~1 token per
    inactive-expert chunk equals the one with every token in one chunk, up to fp32 rounding.

    Chunking changes only how BLAS blocks the rows of the (no-autograd) expert matmuls, hence the rounding
    of each straight-through coefficient a[n, j] = <g_n, E_j(x_n)>. Standard fp32 error analysis: a chain of
    reductions of lengths H (gate/up), I (down), H (<g, E>) and N (router gradient, summed over tokens)
    changes each result by at most eps * (2H + I + N) times the same computation in absolute values:
    C[n, j] = sum_i |g_ni| (|W_down| (1.1 |W_gate||x| |up| + |silu(gate)| |W_up||x| + |silu(gate)||up|))_i
    (1.1 bounds |silu'|), through the softmax Jacobian |J| = |diag(p) - p p^T|, times |x| for the weight
    gradient: tol = eps * (2H + I + N) * sum_n (|J_n|^T C_n) |x_n|^T."""
    base = build_tiny("olmoe").train()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, base.config.hidden_size, generator=gen)
    g = torch.randn(40, base.config.hidden_size, generator=gen)
    grads = []
    for budget in (1e-4, 256.0):  # 1 token per chunk vs everything at once
        model = copy.deepcopy(base)
        patch = moe_lab.apply(model, "densemixer", memory_budget_mb=budget)
        block = patch.layers[0]
        assert block.mixer.chunk_tokens == 1 if budget < 1 else block.mixer.chunk_tokens >= x.shape[0]
        (block(x[None]) * g[None]).sum().backward()
        grads.append(block.gate.weight.grad)
    view = patch.views[0]
    experts = view.experts
    hidden, inter = view.config.hidden_size, view.down_proj.shape[2]
    with torch.no_grad():
        p = torch.softmax(x @ block.gate.weight.T, dim=-1)
        bound = torch.zeros(x.shape[0], view.num_experts)
        for j in range(view.num_experts):
            w_gate, w_up = experts.gate_up_proj[j][:inter], experts.gate_up_proj[j][inter:]
            gate, up = x @ w_gate.T, x @ w_up.T
            act = torch.nn.functional.silu(gate)
            h_abs = (1.1 * (x.abs() @ w_gate.abs().T) * up.abs() + act.abs() * (x.abs() @ w_up.abs().T)
                     + act.abs() * up.abs())
            bound[:, j] = (g.abs() * (h_abs @ experts.down_proj[j].abs().T)).sum(-1)
        jacobian = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]).abs()  # [N, j, e]
        per_logit = torch.einsum("nje,nj->ne", jacobian, bound)
        eps = torch.finfo(torch.float32).eps
        tol = eps * (2 * hidden + inter + x.shape[0]) * (per_logit.T @ x.abs())
    assert (grads[0] - grads[1]).abs().le(tol).all(), float(((grads[0] - grads[1]).abs() / tol).max())
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("family", DEFINED)
def test_dense_forward_conventional_gradient_ablation(family):
    """The paper's ablation: while training, the experts' mixture = HF's + sum over inactive (token, e) of
    w_e E_e(x) (dense weights written out from the routing rule, E_e by HF's packed experts), and the block wraps
    it as HF's block does (shared experts, scaling, norms: HF's block fed that mixture gives the block output bit
    for bit); the mixture's gradients (same upstream g at the mixture) = conventional SFT's, bit for bit (at the
    block output they differ where the block normalises its output: the norm sees the dense value); in eval mode
    the value is the conventional one, bit for bit.

    Mixture tolerance: the dense sum adds E - k terms to HF's mixture in another order, each term a chain of
    reductions of lengths H and I: eps * (2H + I + E) * (|mix_hf| + sum_e |w_e| |E_e(x)|)."""
    vanilla = build_tiny(family).train()
    conventional, ours = copy.deepcopy(vanilla), copy.deepcopy(vanilla)
    p_conv = moe_lab.apply(conventional, "sft")
    patch = moe_lab.apply(ours, "densemixer", forward="dense", gradient="conventional")
    block, view = patch.layers[0], patch.views[0]
    hidden = vanilla.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, hidden, generator=gen)
    g = torch.randn(14, hidden, generator=gen)
    outs, inputs, mixtures = [], [], []
    for layer in (p_conv.layers[0], block):
        mixer = layer.mixer
        layer.mixer = lambda *args, mixer=mixer: mixtures.append(mixer(*args)) or mixtures[-1]
        x1 = x.clone().requires_grad_(True)
        outs.append(_first(layer(x1)).detach())
        mixtures[-1].backward(g)
        inputs.append(x1.grad)
        layer.mixer = mixer
    assert torch.equal(inputs[0], inputs[1])
    conv_params = dict(p_conv.layers[0].named_parameters())
    for name, param in block.named_parameters():
        ref = conv_params[name].grad
        assert (param.grad is None and ref is None) or torch.equal(param.grad, ref), name
    assert view.router_weight.grad.abs().sum() > 0

    hf_block, seen = _hf_block(patch)
    with torch.no_grad():
        assert torch.equal(_first(hf_block(x)), outs[0]), "HF's block is the conventional one"
        w, indices = _anchored_weights(view, seen["route"])
        flat, hf_mix = seen["x"], seen["mix"].reshape(-1, hidden)
        inactive = torch.ones_like(w, dtype=torch.bool).scatter_(1, indices, False)
        expert_out = _expert_outputs(hf_block.experts, flat, view.num_experts)
        expected = hf_mix + (w[..., None] * inactive[..., None] * expert_out).sum(1)
        eps = torch.finfo(torch.float32).eps
        tol = eps * _length(view, 0) * (hf_mix.abs() + (w[..., None] * expert_out).abs().sum(1))
        got = mixtures[1].detach().reshape(-1, hidden)
        assert (got - expected).abs().le(tol).all()
        assert (got - hf_mix).abs().max() > 1e3 * tol.max(), "the dense mixture must differ"
        hf_block.experts.register_forward_hook(lambda m, a, o: got.reshape(o.shape))
        assert torch.equal(_first(hf_block(x)), outs[1]), "the block wraps the dense mixture as HF's does"
    block.eval(), p_conv.layers[0].eval()
    with torch.no_grad():
        evaluated = [_first(layer(x)) for layer in (p_conv.layers[0], block)]
    assert torch.equal(evaluated[0], evaluated[1])


@pytest.mark.parametrize("options,message", [
    ({"gradient": "ste"}, r"method.options.gradient='ste' is not one of"),
    ({"forward": "full"}, r"method.options.forward='full' is not one of"),
    ({"gradient": "conventional"}, "is method=sft"),
    ({"forward": "dense"}, "ablation with gradient=conventional"),
])
def test_bad_variants_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        moe_lab.apply(build_tiny("olmoe"), "densemixer", **options)


def test_rejects_sparsemixer_and_bad_budget():
    with pytest.raises(ValueError, match="sparsemixer"):
        moe_lab.apply(build_tiny("phimoe"), "densemixer")
    with pytest.raises(ValueError, match="memory_budget_mb"):
        moe_lab.apply(build_tiny("olmoe"), "densemixer", memory_budget_mb=0)
