"""A routing weight that scales the expert INPUT (registry ``weight_on_input``; Llama 4): the installed block against
a float64 hand computation of y = shared(x) + sum_{e in TopK(l)} E_e(sigmoid(l_e) x), written from the packed tensors
(independent of HF's dense bmm, which the conformance suite compares bit for bit); the methods and scores whose math
assumes output weights are refused by name, the others run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_lab
from moe_lab.compress.calibration import calibrate
from moe_lab.compress.condense import build_condensed
from moe_lab.compress.scores import scores
from moe_lab.distill import widen_teacher
from tests.conftest import build_tiny, random_batch


def _swiglu(x, gate_up, down):
    """One expert of the [H, 2I] (gate columns, then up columns) / [I, H] layout on tokens ``x`` [n, H]."""
    gate, up = (x @ gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down


@pytest.mark.parametrize("top_k", [1, 2])
def test_block_equals_the_input_scaled_hand_computation(top_k):
    model = build_tiny("llama4_text", num_experts_per_tok=top_k).double().eval()
    patch = moe_lab.apply(model, "sft")
    hidden = model.config.hidden_size
    x = torch.randn(2, 7, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    flat = x.reshape(-1, hidden)
    for view, block in zip(patch.views, patch.layers):
        with torch.no_grad():
            out, logits = block(x)
            z = flat @ view.router_weight.T
            top, idx = z.topk(top_k, dim=-1)
            weights = top.float().sigmoid().to(top.dtype)  # as HF: the sigmoid in fp32, cast back
            shared = view.shared
            expected = shared.down_proj(F.silu(shared.gate_proj(flat)) * shared.up_proj(flat))
            output_weighted = expected.clone()
            gate_up, down = view.gate_up_proj, view.down_proj
            for t in range(flat.shape[0]):
                for slot in range(top_k):
                    e, w = int(idx[t, slot]), weights[t, slot]
                    expected[t] += _swiglu(w * flat[t:t + 1], gate_up[e], down[e])[0]
                    output_weighted[t] += w * _swiglu(flat[t:t + 1], gate_up[e], down[e])[0]
        assert torch.equal(logits, z)  # the block's second output: the router logits, as HF's
        # the weights are fp32 sigmoids (HF's), which CPU kernels round by tensor size: 1 ulp of fp32 per weight, a
        # few ulps of the output after the SwiGLU; everything else is float64
        tol = 8 * torch.finfo(torch.float32).eps * float(expected.abs().max())
        torch.testing.assert_close(out.reshape(-1, hidden), expected, rtol=0, atol=tol)
        assert (output_weighted - expected).abs().max() > 1e-3, "input and output weighting must differ here"
        assert int(block.counts.sum()) == 0, "eval forwards count nothing"


@pytest.mark.parametrize("method", ["densemixer", "compressed_experts"])
def test_output_weighted_methods_are_refused_by_name(method):
    with pytest.raises(ValueError, match=f"{method} is not defined for llama4_text: .*here the routing weight scales "
                                         r"the expert input, y = sum_e E_e\(w_e x\)"):
        moe_lab.apply(build_tiny("llama4_text", num_experts_per_tok=2), method)


def test_condensed_layers_are_refused_by_name():
    view = moe_lab.apply(build_tiny("llama4_text")).views[0]
    with pytest.raises(ValueError, match="condense is not defined for llama4_text: condensed layers are shared"):
        build_condensed(view, None, [0], gates=torch.ones(view.num_experts))


def test_output_gated_scores_refused_and_the_others_computed():
    calibration = calibrate(build_tiny("llama4_text"), [random_batch()])
    with pytest.raises(ValueError, match="reap is not defined for llama4_text: REAP scores an expert by its router"):
        scores(calibration, "reap")
    with pytest.raises(ValueError, match="es_mag is not defined for llama4_text: gated ES-Mag"):
        scores(calibration, "es_mag")
    for method, options in (("es_mag", {"variant": "ungated"}), ("ean_mean", {}), ("do_acp", {}), ("es_act", {})):
        for layer, score in scores(calibration, method, **options).items():
            assert score.shape == (8,) and bool(torch.isfinite(score).all()), (method, layer)


def test_widened_teacher_equals_hf_at_the_wider_top_k():
    """KD's teacher routing widened to k' = 2 on the top-1 family: exactly HF's own block configured with top-2
    (the family rule: each weight the sigmoid of its logit, on the expert input)."""
    model = build_tiny("llama4_text").eval()
    wide = build_tiny("llama4_text", num_experts_per_tok=2).eval()
    batch = random_batch()
    patch = widen_teacher(model, 2)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, wide(**batch).logits)
    patch.remove()
    with torch.no_grad():
        assert not torch.equal(model(**batch).logits, wide(**batch).logits)
