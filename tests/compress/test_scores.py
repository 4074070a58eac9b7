"""Expert scores and selection (spec 2.2, 2.4, 4.1; oracle tests 2.15-8, 4.9) on hand-made and tiny-model statistics."""

from __future__ import annotations

import math

import pytest
import torch

from moe_lab.compress import Calibration, calibrate, dopt, scores, select_experts
from moe_lab.compress.scores import METHODS, ranking
from tests.conftest import build_tiny, random_batch

f64 = torch.float64


def hand_calibration() -> Calibration:
    """E = 4, k = 2, n = 5 tokens in 2 sequences; sums chosen so every score is a short fraction."""
    stats = {
        "n": torch.tensor(5), "num_seqs": torch.tensor(2),
        "count": torch.tensor([5, 3, 2, 0]),
        "p_sum": torch.tensor([2.0, 1.5, 1.0, 0.5], dtype=f64),
        "p_sel": torch.tensor([2.0, 1.2, 0.6, 0.0], dtype=f64),
        "sq_norm": torch.tensor([20.0, 45.0, 5.0, 80.0], dtype=f64),
        "gram": torch.diag(torch.tensor([20.0, 45.0, 5.0, 80.0], dtype=f64)),
        "wnorm_sel": torch.tensor([5.0, 6.0, 1.0, 0.0], dtype=f64),
        "norm_sel": torch.tensor([10.0, 9.0, 4.0, 0.0], dtype=f64),
        "seq_act": torch.tensor([2.0, 1.2, 0.8, 0.0], dtype=f64),
        "seq_mag": torch.tensor([3.0, 1.0, 2.0, 0.0], dtype=f64),
        "seq_mag_ungated": torch.tensor([4.0, 6.0, 2.0, 8.0], dtype=f64),
    }
    return Calibration({"num_experts": 4, "top_k": 2}, {3: stats})


HAND = {  # hand-computed from hand_calibration()
    "sf": [1.0, 0.6, 0.4, 0.0],           # count / 5
    "pp": [0.4, 0.3, 0.2, 0.1],           # p_sum / 5
    "ps": [0.4, 0.24, 0.12, 0.0],         # p_sel / 5
    "cp": [0.4, 0.4, 0.3, 0.0],           # p_sel / count, 0 when never selected
    "acp": [0.8, 1.2, 0.3, 0.0],          # cp * sqrt(sq_norm / 5) = cp * [2, 3, 1, 4]
    "do_cp": [0.4, 0.4, 0.3, 0.0],        # base importance
    "do_acp": [0.8, 1.2, 0.3, 0.0],
    "reap": [1.0, 2.0, 0.5, 0.0],         # wnorm_sel / count
    "ean": [2.0, 3.0, 2.0, 0.0],          # norm_sel / count (= ean_mean)
    "ean_mean": [2.0, 3.0, 2.0, 0.0],     # REAP's ean_mean: norm_sel / count
    "ean_sum": [10.0, 9.0, 4.0, 0.0],     # REAP's ean_sum: norm_sel
    "es_act": [0.5, 0.3, 0.2, 0.0],       # seq_act / (2 sequences * k=2)
    "es_mag": [1.5, 0.5, 1.0, 0.0],       # seq_mag / 2
}


@pytest.mark.parametrize("method", sorted(HAND))
def test_hand_computed_scores(method):
    got = scores(hand_calibration(), method)[3]
    assert got.dtype == f64
    torch.testing.assert_close(got, torch.tensor(HAND[method], dtype=f64), rtol=1e-15, atol=1e-15)


def test_es_mag_ungated_and_rankings_with_ties():
    cal = hand_calibration()
    torch.testing.assert_close(scores(cal, "es_mag", variant="ungated")[3], torch.tensor([2.0, 3.0, 1.0, 4.0], dtype=f64))
    assert select_experts(cal, "cp", 2)[3].tolist() == [0, 1]       # CP tie 0.4 / 0.4 -> lower index first
    assert select_experts(cal, "ean", 3)[3].tolist() == [1, 0, 2]   # EAN tie 2 / 2 -> lower index first
    assert select_experts(cal, "ean_sum", 3)[3].tolist() == [0, 1, 2]  # the sum favours the frequent expert 0
    assert select_experts(cal, "sf", 4)[3].tolist() == [0, 1, 2, 3]
    assert ranking(torch.tensor([0.0, 1.0, 1.0, 0.0])).tolist() == [1, 2, 0, 3]
    # diagonal Gram: DO selects top-K by K_ee = I_e * v_e (not by I_e): DO-ACP ranks by CP * v^(3/2)
    do = select_experts(cal, "do_acp", 2)[3].tolist()
    k_ee = torch.tensor(HAND["acp"], dtype=f64) * torch.tensor([4.0, 9.0, 1.0, 16.0], dtype=f64)
    assert do == ranking(k_ee)[:2].tolist() == [1, 0]


def test_random_scores_are_seeded_permutations():
    cal = hand_calibration()
    a, b, c = (scores(cal, "random", seed=s)[3] for s in (0, 0, 1))
    assert torch.equal(a, b) and sorted(a.tolist()) == [0.25, 0.5, 0.75, 1.0]
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(4, generator=gen)
    assert select_experts(cal, "random", 4, seed=1)[3].tolist() == perm.tolist()
    assert torch.equal(ranking(c), perm)


@pytest.fixture(scope="module")
def tiny_cals():
    """Calibrations of four families: equal-length sequences (no padding) and padded ones."""
    out = {}
    for family in ("qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"):
        model = build_tiny(family)
        equal = [random_batch(seed=s, pad_rows=()) for s in range(2)]
        padded = [random_batch(seed=s) for s in range(2)]
        out[family] = (calibrate(model, equal), calibrate(model, padded))
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_score_identities_on_tiny_models(tiny_cals, family):
    equal, padded = tiny_cals[family]
    for cal in (equal, padded):
        k, E = cal.manifest["top_k"], cal.manifest["num_experts"]
        sf, pp, ps, cp, acp = (scores(cal, m) for m in ("sf", "pp", "ps", "cp", "acp"))
        es_act, reap, ean = scores(cal, "es_act"), scores(cal, "reap"), scores(cal, "ean")
        for layer, st in cal.layers.items():
            n = int(st["n"])
            assert int(st["count"].sum()) == n * k  # sum SF = k exactly, in integers
            assert float(sf[layer].sum()) == pytest.approx(k, rel=1e-15)
            if cal.manifest["p_definition"] == "softmax_all":  # fp32 softmax rows sum to 1 within E ulps
                assert abs(float(pp[layer].sum()) - 1) <= E * torch.finfo(torch.float32).eps
            torch.testing.assert_close(ps[layer], sf[layer] * cp[layer], rtol=1e-14, atol=1e-15)
            assert bool(((cp[layer] >= 0) & (cp[layer] <= 1 + 1e-7)).all())
            never = st["count"] == 0
            assert bool((cp[layer][never] == 0).all() and (reap[layer][never] == 0).all())
            assert bool((ean[layer][never] == 0).all())
            v = (st["gram"] / n).diagonal()
            torch.testing.assert_close(acp[layer], cp[layer] * v.sqrt(), rtol=1e-14, atol=0)
            assert float(es_act[layer].sum()) == pytest.approx(1.0, rel=1e-12)
        if cal is equal:  # ES-Act = SF / k when every sequence has the same length
            for layer in cal.layers:
                torch.testing.assert_close(es_act[layer], sf[layer] / k, rtol=1e-12, atol=1e-15)
    assert any(bool((st["count"] == 0).any()) for st in tiny_cals["deepseek_v3"][1].layers.values())


def test_dopt_selection_matches_independent_kernel(tiny_cals):
    cal = tiny_cals["qwen3_moe"][1]
    for method, base in (("do_cp", "cp"), ("do_acp", "acp")):
        importance = scores(cal, base)
        for K in (2, 3, 5):
            chosen = select_experts(cal, method, K)
            for layer, st in cal.layers.items():
                n = int(st["n"])
                root = importance[layer].sqrt()
                kern = torch.outer(root, root) * st["gram"] / n
                lam = float(kern.trace()) / (K * kern.shape[0])
                assert chosen[layer].tolist() == dopt.naive_greedy(kern, K, lam).order
            explicit = select_experts(cal, method, K, lam=0.05)
            assert all(explicit[layer].tolist() == dopt.greedy(dopt.kernel(importance[layer], st["gram"] / int(st["n"])),
                                                              K, 0.05).order for layer, st in cal.layers.items())


def test_bad_input_is_named(tiny_cals):
    cal = hand_calibration()
    with pytest.raises(ValueError, match="unknown score 'foo' .compress.score.: choose one of sf, pp"):
        scores(cal, "foo")
    with pytest.raises(ValueError, match="compress.K=5 must be between 1 and num_experts=4"):
        select_experts(cal, "sf", 5)
    with pytest.raises(TypeError, match="lam"):
        scores(cal, "sf", lam=0.1)  # a misspelt or misplaced option is not silently ignored
    with pytest.raises(ValueError, match="es_mag variant='both'"):
        scores(cal, "es_mag", variant="both")
    del cal.layers[3]["gram"]
    with pytest.raises(ValueError, match="lacks statistic 'gram' .layer 3. needed by score do_acp"):
        select_experts(cal, "do_acp", 2)
    scores(cal, "acp")  # ACP does not need the Gram matrix
    cal = hand_calibration()
    cal.layers[3]["p_sel"][2] = math.nan
    with pytest.raises(ValueError, match="'p_sel' is not finite at layer 3, expert 2"):
        scores(cal, "cp")
    cal = hand_calibration()
    cal.layers[3]["p_sel"].zero_()
    with pytest.raises(ValueError, match="lambda=0.0 is not positive"):
        select_experts(cal, "do_cp", 2)
    assert set(METHODS) == {"sf", "pp", "ps", "cp", "acp", "do_cp", "do_acp", "reap", "ean", "ean_mean", "ean_sum",
                            "es_act", "es_mag", "random"}
