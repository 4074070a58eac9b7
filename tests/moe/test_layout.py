"""Expert layouts (moe_lab.moe.layout): per-expert tensors and SwiGLU roles are VIEWS of the real parameters in every
layout (packed, GPT-OSS interleaved, Llama 4 transposed, DBRX's [E*I, H] rows), so in-place edits and gradients
reach the weights.

Oracle: the HF tensors indexed by hand (DBRX: expert e owns rows e*I .. (e+1)*I-1 of w1 / v1 / w2)."""

from __future__ import annotations

import pytest
import torch

from moe_lab.moe.layout import expert_mask, leading_mask
from moe_lab.moe.view import find_moe_layers
from tests.conftest import build_tiny


def _same_storage(view_tensor: torch.Tensor, param: torch.Tensor) -> bool:
    return view_tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", "llama4_text",
                                    *(pytest.param(f, marks=pytest.mark.slow) for f in ("dbrx", "aria_text"))])
def test_expert_tensors_and_roles_are_views_of_the_parameters(family):
    view = find_moe_layers(build_tiny(family))[0]
    params = dict(view.expert_module.named_parameters(recurse=False))
    tensors = view.expert_parameters()
    assert set(tensors) == set(params)
    for name, tensor in tensors.items():
        assert tensor.shape[0] == view.num_experts and _same_storage(tensor, params[name]), name
    gate, up, down = view.roles()
    I, H = gate.shape[1], gate.shape[2]
    assert up.shape == gate.shape == (view.num_experts, I, H) and down.shape == (view.num_experts, H, I)
    assert all(any(_same_storage(role, p) for p in params.values()) for role in (gate, up, down))


@pytest.mark.slow
def test_dbrx_roles_are_the_hand_indexed_rows_and_edits_reach_them():
    model = build_tiny("dbrx")
    view = find_moe_layers(model)[0]
    mlp, I = view.experts.mlp, view.experts.ffn_hidden_size
    gate, up, down = view.roles()
    for e in (0, 5):
        rows = slice(e * I, (e + 1) * I)
        assert torch.equal(gate[e], mlp.w1[rows]) and torch.equal(up[e], mlp.v1[rows])
        assert torch.equal(down[e], mlp.w2[rows].T)  # applied as h @ w2_e = F.linear(h, down_e)
    with torch.no_grad():
        gate[3].zero_()  # an in-place method edit on a slice
    assert not mlp.w1[3 * I:4 * I].any() and mlp.w1[:3 * I].abs().sum() > 0 and mlp.w1[4 * I:].abs().sum() > 0
    (down[2].sum() * 2).backward()  # a gradient through a slice lands on expert 2's rows only
    grad = mlp.w2.grad
    assert torch.equal(grad[2 * I:3 * I], torch.full((I, grad.shape[1]), 2.0)) and grad.abs().sum() == 2 * I * grad.shape[1]


def test_leading_mask_tiles_expert_blocks():
    mask = torch.tensor([True, False, True, False])
    assert torch.equal(leading_mask(mask, torch.zeros(4, 3, 2)), mask)  # packed: one index per expert
    rows = leading_mask(mask, torch.zeros(12, 5))  # DBRX-like: 3 rows per expert
    assert rows.tolist() == [True] * 3 + [False] * 3 + [True] * 3 + [False] * 3
    assert torch.equal(expert_mask(rows, 4), mask)
    with pytest.raises(ValueError, match="does not tile a tensor of leading size 10"):
        leading_mask(mask, torch.zeros(10, 5))


@pytest.mark.parametrize("family", ["llama4_text", "gpt_oss", pytest.param("aria_text", marks=pytest.mark.slow)])
def test_transposed_roles_are_the_hand_indexed_columns_and_edits_reach_them(family):
    """Llama 4 and Aria ('transposed': gate_up [E, H, 2I] gate columns then up, down [E, I, H]) and GPT-OSS (the
    same, gate / up columns interleaved): the roles are transposed views of the packed tensors."""
    view = find_moe_layers(build_tiny(family))[0]
    experts = view.experts
    chunked = family != "gpt_oss"
    gate, up, down = view.roles()
    I = gate.shape[1]
    for e in (0, view.num_experts - 1):
        w = experts.gate_up_proj[e]
        gate_cols, up_cols = (w[:, :I], w[:, I:]) if chunked else (w[:, 0::2], w[:, 1::2])
        assert torch.equal(gate[e], gate_cols.T) and torch.equal(up[e], up_cols.T)
        assert torch.equal(down[e], experts.down_proj[e].T)  # h @ down_proj[e] = F.linear(h, down_e)
    with torch.no_grad():
        up[1].zero_()
    w = experts.gate_up_proj[1]
    assert not (w[:, I:] if chunked else w[:, 1::2]).any()
    assert (w[:, :I] if chunked else w[:, 0::2]).abs().sum() > 0
    assert experts.gate_up_proj[0].abs().sum() > 0


@pytest.mark.parametrize("family", ["olmoe", "llama4_text",
                                    *(pytest.param(f, marks=pytest.mark.slow) for f in ("dbrx", "aria_text"))])
def test_concatenated_expert_is_the_alpha_weighted_sum(family):
    """compress.dense.concat_experts in each SwiGLU layout, float64: the one concatenated expert, applied by hand
    as the layout stores it, equals sum_g alpha_g E_g(x) (E_g: expert_forward, checked against HF's experts)."""
    from moe_lab.compress.dense import concat_experts
    from moe_lab.moe.experts import expert_forward

    view = find_moe_layers(build_tiny(family).double())[0]
    ids, alpha = (0, 2, 3), torch.tensor([0.25, 1.5, -0.5], dtype=torch.float64)
    params = view.expert_parameters()
    with torch.no_grad():
        one = concat_experts(view, [{n: t[e] for n, t in params.items()} for e in ids], alpha)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(7, view.config.hidden_size, dtype=torch.float64, generator=gen)
        act = view.layout.activation(view.experts)
        if family == "olmoe":  # [2kI, H] gate rows then up rows, [H, kI]
            gate, up = (x @ one["gate_up_proj"].T).chunk(2, dim=-1)
            y = (act(gate) * up) @ one["down_proj"].T
        elif family in ("llama4_text", "aria_text"):  # [H, 2kI] gate columns then up columns, [kI, H]
            gate, up = (x @ one["gate_up_proj"]).chunk(2, dim=-1)
            y = (act(gate) * up) @ one["down_proj"]
        else:  # DBRX: w1 / v1 / w2 [kI, H]
            y = (act(x @ one["w1"].T) * (x @ one["v1"].T)) @ one["w2"]
        expected = sum(a * expert_forward(view, e, x) for e, a in zip(ids, alpha.tolist()))
    assert y.shape == x.shape and expected.abs().max() > 0
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)  # float64 reassociation only
