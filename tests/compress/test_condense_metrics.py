"""CD-MoE metrics (issue 18 item 12): PPL layer metric per sequence, PL_Alpha_Hill's Fix-Finger k_h, fp32
fixed gates, active parameters (the paper's Table 1 column) -- against hand computations."""

from __future__ import annotations

import copy

import torch

from moe_lab.compress import calibrate, condense, export_condensed, load_condensed
from moe_lab.compress.condense import fixed_gates
from moe_lab.compress.condense_search import (
    LayerSearch,
    active_params,
    alpha_hill,
    alpha_hill_eigenvalues,
    trim,
)
from moe_lab.moe import find_moe_layers
from tests.compress.test_condense_counts import build, condensed
from tests.conftest import build_tiny, random_batch


def _seq_ppl(model, batch) -> list[float]:
    """Each row's perplexity in float64 from the logits (real next-token targets only)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    out = []
    for row in range(logits.shape[0]):
        m = batch["attention_mask"][row].bool()
        lg, ids = logits[row][m], batch["input_ids"][row][m]
        nll = -torch.log_softmax(lg[:-1], -1).gather(1, ids[1:, None]).squeeze(1)
        out.append(float(torch.exp(nll.mean())))
    return out


def test_ppl_layer_metric_averages_sequences_not_batches():
    model = build_tiny("deepseek_v2").eval()
    data = [random_batch(3, 10, seed=1), random_batch(1, 10, seed=2, pad_rows=())]  # last batch short
    cal = calibrate(model, data)
    layer = cal.moe_layers[0]
    search = LayerSearch(model, cal, data, {layer: [0, 1]}, metric="ppl")
    got = search.loss([layer])
    tmp = condense(copy.deepcopy(model), cal, [layer], {layer: [0, 1]})
    deltas = [[a - b for a, b in zip(_seq_ppl(tmp, b), _seq_ppl(model, b))] for b in data]
    per_seq = sum(sum(d) for d in deltas) / 4
    per_batch = sum(sum(d) / len(d) for d in deltas) / 2
    assert abs(got - per_seq) < 1e-4 * max(1.0, abs(per_seq))
    assert abs(per_seq - per_batch) > 1e-3  # the old per-batch mean is distinguishable here


def test_alpha_hill_fix_finger_recovers_a_power_law_and_eq6_by_hand():
    gen = torch.Generator().manual_seed(0)
    alpha, n = 3.0, 800
    lam = 0.5 * torch.rand(n, generator=gen, dtype=torch.float64).pow(-1 / (alpha - 1))  # density ~ lam^-alpha
    est = alpha_hill_eigenvalues(lam)  # xmin="peak": a pure power law's ESD peaks at its smallest eigenvalues
    assert abs(est - alpha) < 0.2
    s = lam.sort().values
    k = 10  # Eq. 6 by hand for a fixed k_h
    want = 1 + k / sum(float(torch.log(s[n - i] / s[n - k - 1])) for i in range(1, k + 1))
    assert abs(alpha_hill_eigenvalues(lam, k=k) - want) < 1e-12
    mid = 1 + (n // 2) / float(torch.log(s[n - n // 2:] / s[n - n // 2 - 1]).sum())
    assert abs(alpha_hill_eigenvalues(lam, xmin="mid") - mid) < 1e-12
    # a bulk below the tail: Fix-Finger puts x_min at the peak, the middle k_h does not
    bulk = torch.cat([1 + 0.01 * torch.rand(3 * n, generator=gen, dtype=torch.float64), 1.02 * s / s[0]])
    assert abs(alpha_hill_eigenvalues(bulk) - alpha) < abs(alpha_hill_eigenvalues(bulk, xmin="mid") - alpha)
    w = torch.randn(24, 16, generator=gen, dtype=torch.float64)  # the matrix path: eigenvalues of W^T W
    assert abs(alpha_hill(w) - alpha_hill_eigenvalues(torch.linalg.eigvalsh(w.T @ w))) < 1e-9


def test_fixed_gates_stay_fp32_through_casts_and_export(tmp_path):
    model = build_tiny("deepseek_v2").eval()
    cal = calibrate(model, [random_batch(3, 10, seed=0)])
    layer = cal.moe_layers[0]
    condense(model, cal, [layer], {layer: [0, 1, 2]})
    module = model.get_submodule(f"model.layers.{layer}.mlp")
    want = fixed_gates(cal, layer)[0][[0, 1, 2]].float()
    assert module.gates.dtype == torch.float32 and torch.equal(module.gates, want)
    assert not torch.equal(want.bfloat16().float(), want)  # a bf16 gate would lose bits
    model.to(torch.bfloat16)
    assert module.gates.dtype == torch.float32 and torch.equal(module.gates, want)
    assert module.gate_up_proj.dtype == torch.bfloat16
    back = load_condensed(export_condensed(model, tmp_path / "x"))
    got = back.get_submodule(f"model.layers.{layer}.mlp").gates
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_active_parameters_deepseekmoe_16b_table1():
    """Paper Table 1 'Active' column on the converted DeepSeekMoE-16B (+ one zero 2048-wide gate per MoE layer
    still routed or condensed): original 2.8B, CD-MoE-S 2.4B, CD-MoE-SR 2.8B match arithmetic; LayerTrim
    2.4B and BlockTrim 2.3B do not (2.27B / 2.14B)."""
    model = build("deepseek_moe_16b")
    h, i_moe = 2048, 1408
    expert = 3 * h * i_moe
    gate = h  # the converter's zero shared-expert gate per MoE layer
    original = 16_375_728_128 - 27 * 58 * expert
    assert active_params(model) == original + 27 * gate == 2_828_650_496 + 27 * gate
    eight, nine = list(range(1, 9)), list(range(1, 10))
    router = 64 * h
    s = active_params(condensed(model, eight, 0))
    sr = active_params(condensed(model, nine, 6))
    lt = active_params(trim(copy.deepcopy(model), eight, "moe"))
    bt = active_params(trim(copy.deepcopy(model), eight, "block"))
    assert s == original - 8 * (6 * expert + router) + 27 * gate
    assert sr == original - 9 * router + 27 * gate
    shared = 3 * h * 2 * i_moe
    assert lt == original - 8 * (6 * expert + router + shared) + 19 * gate
    assert bt == lt - 8 * (4 * h * h + 2 * h)
    assert [round(v / 1e9, 2) for v in (original, s, sr, lt, bt)] == [2.83, 2.41, 2.83, 2.27, 2.14]


def test_active_parameters_when_every_moe_layer_is_condensed():
    """Every MoE layer condensed (no routed layer left): every retained parameter is active."""
    model = build_tiny("olmoe")
    layers = [v.index for v in find_moe_layers(model)]
    whole = condensed(model, layers, 1)
    assert active_params(whole) == sum(p.numel() for p in whole.parameters())
