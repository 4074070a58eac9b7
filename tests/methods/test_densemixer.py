"""DenseMixer against a dense autograd oracle (DESIGN.md, "Methods, precisely")."""

from __future__ import annotations

import copy

import pytest
import torch

import moe_lab
from moe_lab.methods.densemixer import dense_weights
from tests.conftest import build_tiny, random_batch


def _hf_expert_output(experts, x, e):
    """Expert e on every token, computed by the HF packed-experts module itself (weight 1)."""
    n = x.shape[0]
    return experts(x, torch.full((n, 1), e, dtype=torch.long), torch.ones(n, 1, dtype=x.dtype))


def _oracle_dense_weights(family, logits, indices, config):
    """The dense weights written out per family, independently of the routing code."""
    selected = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, True)
    if family == "olmoe" or family == "qwen2_moe":  # softmax, no renormalisation
        return torch.softmax(logits.float(), dim=-1)
    if family == "deepseek_v2":  # softmax, no renormalisation, routed scaling
        return torch.softmax(logits.float(), dim=-1) * config.routed_scaling_factor
    if family == "qwen3_moe" or family == "mixtral":  # softmax, renormalised over the top-k
        p = torch.softmax(logits.float(), dim=-1)
        s = (p * selected).sum(-1, keepdim=True)
        return torch.where(selected, p / s, p / s.detach())
    if family == "deepseek_v3":  # sigmoid, renormalised, routed scaling
        p = torch.sigmoid(logits.float())
        s = (p * selected).sum(-1, keepdim=True) + 1e-20
        return torch.where(selected, p / s, p / s.detach()) * config.routed_scaling_factor
    if family == "gpt_oss":  # softmax over the top-k logits, extended with a stop-grad normaliser
        ex = torch.exp(logits.float())  # tiny logits: no max-subtraction needed
        z = (ex * selected).sum(-1, keepdim=True)
        return torch.where(selected, ex / z, ex / z.detach())
    raise AssertionError(family)


ORACLE_FAMILIES = ["olmoe", "qwen3_moe", "qwen2_moe", "deepseek_v2", "mixtral", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("gradient", ["straight_through", "paper_eq15"])
@pytest.mark.parametrize("family", ORACLE_FAMILIES)
def test_block_matches_dense_autograd_oracle(family, gradient):
    """Every family DenseMixer supports (all but sparsemixer's PhiMoE), both router-gradient estimators.

    Oracle: the surrogate loss <g, y_hf> + sum_(token, e) stopgrad(A_e) * w_e, with w the dense weights
    written out per family above and A = (1 - M_e) <g, E_e(x)> (straight-through: every expert gets
    <g, E_e(x)>, the selected ones through HF's own sparse path) or A = w_e <g, E_e(x)> (Eq. 15:
    (w_e + M_e) <g, E_e(x)>, the M_e part again through HF's path); E_e run by HF's packed experts."""
    vanilla = build_tiny(family).train()
    ours = copy.deepcopy(vanilla)
    patch = moe_lab.apply(ours, "densemixer", gradient=gradient)
    block = patch.layers[0]
    hf_block = patch.views[0].block  # the vanilla block object shares the parameters ...
    hf_block = copy.deepcopy(hf_block)  # ... so the oracle gets its own copy
    hf_router_cls = type(vanilla.get_submodule(patch.views[0].name + "." + patch.spec.router_attr))
    getattr(hf_block, patch.spec.router_attr).__class__ = hf_router_cls

    gen = torch.Generator().manual_seed(3)
    hidden = vanilla.config.hidden_size
    x = torch.randn(2, 7, hidden, generator=gen)
    g = torch.randn(2, 7, hidden, generator=gen)

    # moe-lab DenseMixer
    x1 = x.clone().requires_grad_(True)
    y1 = block(x1)
    y1 = y1[0] if isinstance(y1, tuple) else y1
    (y1 * g).sum().backward()

    # oracle: <g, y_hf> + sum over inactive (token, expert) of w_dense * <g, E_e(x)>.detach()
    x2 = x.clone().requires_grad_(True)
    y2 = hf_block(x2)
    y2 = y2[0] if isinstance(y2, tuple) else y2
    flat = x2.reshape(-1, hidden)
    router = getattr(hf_block, patch.spec.router_attr)
    logits = torch.nn.functional.linear(flat.float() if family.startswith("deepseek") else flat,
                                        router.weight, getattr(router, "bias", None))
    _, _, indices = router(flat)
    with torch.no_grad():
        contrib = torch.stack(
            [(g.reshape(-1, hidden) * _hf_expert_output(hf_block.experts, flat, e)).sum(-1)
             for e in range(block.num_experts)], dim=1)
    w = _oracle_dense_weights(family, logits, indices, vanilla.config)
    inactive = torch.ones_like(w, dtype=torch.bool).scatter_(1, indices, False)
    coefficient = contrib * inactive if gradient == "straight_through" else contrib * w.detach()
    ((y2 * g).sum() + (w * coefficient).sum()).backward()

    assert torch.equal(y1, y2), "forward value must equal the conventional top-k output bit for bit"
    # same math, summed in another order: reductions of lengths H and I per expert output, E experts and
    # N tokens per gradient entry -> |difference| <= eps * (2H + I + E + N) * the largest gradient entry
    length = 2 * hidden + patch.views[0].down_proj.shape[-1] + block.num_experts + flat.shape[0]

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
    router_grad = getattr(block, patch.spec.router_attr).weight.grad
    assert router_grad.abs().sum() > 0


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
    if family == "phimoe":
        pytest.skip("densemixer is not defined for sparsemixer routing")
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


@pytest.mark.parametrize("family", ORACLE_FAMILIES)
def test_dense_forward_conventional_gradient_ablation(family):
    """The paper's ablation: while training, value = y_hf + sum over inactive (token, e) of w_e E_e(x) (dense
    weights written out per family, E_e by HF's packed experts); every gradient = conventional SFT's, bit for
    bit (same upstream g); in eval mode the value is the conventional one, bit for bit.

    Value tolerance: the dense sum adds E - k terms to HF's output in another order, each term a chain of
    reductions of lengths H and I: eps * (2H + I + E) * (|y_hf| + sum_e |w_e| |E_e(x)|)."""
    vanilla = build_tiny(family).train()
    conventional, ours = copy.deepcopy(vanilla), copy.deepcopy(vanilla)
    p_conv = moe_lab.apply(conventional, "sft")
    patch = moe_lab.apply(ours, "densemixer", forward="dense", gradient="conventional")
    block, view = patch.layers[0], patch.views[0]
    hidden = vanilla.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, hidden, generator=gen)
    g = torch.randn(2, 7, hidden, generator=gen)
    outs, inputs = [], []
    for layer in (p_conv.layers[0], block):
        x1 = x.clone().requires_grad_(True)
        y = layer(x1)
        y = y[0] if isinstance(y, tuple) else y
        (y * g).sum().backward()
        outs.append(y.detach())
        inputs.append(x1.grad)
    assert torch.equal(inputs[0], inputs[1])
    conv_params = dict(p_conv.layers[0].named_parameters())
    for name, param in block.named_parameters():
        ref = conv_params[name].grad
        assert (param.grad is None and ref is None) or torch.equal(param.grad, ref), name

    flat = x.reshape(-1, hidden)
    with torch.no_grad():
        router = getattr(view.block, patch.spec.router_attr)
        logits = torch.nn.functional.linear(flat.float() if family.startswith("deepseek") else flat,
                                            router.weight, getattr(router, "bias", None))
        _, _, indices = router(flat)
        w = _oracle_dense_weights(family, logits, indices, vanilla.config)
        inactive = torch.ones_like(w, dtype=torch.bool).scatter_(1, indices, False)
        expert_out = torch.stack([_hf_expert_output(view.experts, flat, e) for e in range(view.num_experts)], 1)
        terms = w[..., None] * inactive[..., None] * expert_out  # [N, E, H]
        expected = outs[0].reshape(-1, hidden) + terms.sum(1)
        eps = torch.finfo(torch.float32).eps
        length = 2 * hidden + view.down_proj.shape[-1] + view.num_experts
        tol = eps * length * (outs[0].reshape(-1, hidden).abs() + (w[..., None] * expert_out).abs().sum(1))
    got = outs[1].reshape(-1, hidden)
    assert (got - expected).abs().le(tol).all()
    assert (got - outs[0].reshape(-1, hidden)).abs().max() > 1e3 * tol.max(), "the dense value must differ"
    block.eval(), p_conv.layers[0].eval()
    with torch.no_grad():
        evaluated = [layer(x) for layer in (p_conv.layers[0], block)]
    evaluated = [e[0] if isinstance(e, tuple) else e for e in evaluated]
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
