"""Merging and down-projection scaling (spec 2.6-2.7, oracle tests 2.15-6/7)."""

from __future__ import annotations

import pytest
import torch

from moe_lab.compress.merge import merge_coefficients, merge_group, scaling_coefficients


def _params(E=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(E, 8, 4, generator=gen), "down_proj": torch.randn(E, 4, 4, generator=gen),
            "down_proj_bias": torch.randn(E, 4, generator=gen)}


def test_singleton_is_an_exact_copy():
    p = _params()
    out = merge_group(p, [3], merge_coefficients(torch.rand(5), [3]))
    assert all(torch.equal(out[n], p[n][3]) for n in p)


def test_identical_members_merge_to_the_member_for_any_weights():
    p = {n: t[:1].repeat(4, *[1] * (t.dim() - 1)) for n, t in _params().items()}
    for s in (torch.tensor([0.1, 0.7, 0.3, 5.0]), torch.tensor([1.0, 1.0, 1.0, 1.0])):
        out = merge_group(p, [0, 1, 3], merge_coefficients(s, [0, 1, 3]))
        assert all(torch.equal(out[n], p[n][0]) for n in p)


def test_weighted_average_against_float64_reference_and_zero_score_members():
    p = _params()
    s = torch.tensor([0.0, 1.0, 0.0, 3.0, 0.5])
    c = merge_coefficients(s, [1, 3])
    assert c.tolist() == [0.25, 0.75]
    out = merge_group(p, [1, 3], c)
    for n, t in p.items():
        assert torch.equal(out[n], (0.25 * t[1].double() + 0.75 * t[3].double()).float())
    # other members with zero score: the positive-score member exactly
    out = merge_group(p, [0, 3, 2], merge_coefficients(s, [0, 3, 2]))
    assert all(torch.equal(out[n], p[n][3]) for n in p)
    # all-zero group: uniform weights
    assert merge_coefficients(s, [0, 2]).tolist() == [0.5, 0.5]
    assert float(merge_coefficients(torch.rand(5), [0, 1, 4]).sum()) == pytest.approx(1.0, abs=1e-15)


def test_scaling_coefficients_identities():
    s = torch.tensor([0.4, 0.1, 0.0, 0.3, 0.2, 0.6], dtype=torch.float64)
    groups = [[0, 3], [5], [1, 4, 2]]
    k = 3
    prop = scaling_coefficients("proportional", groups, s, k)
    assert float(prop.sum()) == pytest.approx(1.0, abs=1e-15)
    total = s[[0, 3, 5, 1, 4, 2]].sum()
    for g, a in zip(groups, prop):
        eta = a * merge_coefficients(s, g)  # eta_e = alpha_g s_e / S_g == s_e / sum s  (App. F.3)
        assert torch.allclose(eta, s[g] / total, rtol=0, atol=1e-15)
    uni = scaling_coefficients("uniform", groups, s, k)
    for g, a in zip(groups, uni):
        assert float((a * merge_coefficients(s, g)).sum()) == pytest.approx(1 / k, abs=1e-15)
    cp = torch.tensor([0.9, 0.2, 0.0, 0.5, 0.3, 0.8], dtype=torch.float64)
    cond = scaling_coefficients("conditional", [[5], [0], [3, 1]], s, k, cp=cp, routed_scaling=2.0)
    assert cond.tolist() == [1.6, 1.8, pytest.approx(0.7)]
    with pytest.raises(ValueError, match="needs the CP score"):
        scaling_coefficients("conditional", groups, s, k)
    with pytest.raises(ValueError, match="compress.scaling='x'"):
        scaling_coefficients("x", groups, s, k)


def test_negative_scores_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        merge_coefficients(torch.tensor([-1.0, 2.0]), [0, 1])
