import math

import pytest
import torch

from moe_lab.analysis import (
    entropy,
    gini,
    load_fractions,
    load_summary,
    max_mean_imbalance,
    normalized_entropy,
)

from .conftest import ref_load_stats

LOG4 = math.log(4)


@pytest.mark.parametrize(
    "counts, imbalance, gini_value, entropy_value",
    [
        ([4, 0, 0, 0], 4.0, 0.75, 0.0),  # all on one expert: Gini = (E - 1) / E
        ([1, 1, 1, 1], 1.0, 0.0, LOG4),  # balanced
        ([5, 5, 5, 5], 1.0, 0.0, LOG4),
        ([2, 2, 0, 0], 2.0, 0.5, math.log(2)),  # sum|xi-xj| = 16 over 2*16*1
        ([3, 1, 0, 0], 3.0, 0.625, -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))),  # 20 / 32
        ([0, 3, 0, 1], 3.0, 0.625, -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))),  # order-free
        ([6, 0], 2.0, 0.5, 0.0),
    ],
)
def test_hand_computed(counts, imbalance, gini_value, entropy_value):
    t = torch.tensor(counts, dtype=torch.long)
    assert float(max_mean_imbalance(t)) == pytest.approx(imbalance)
    assert float(gini(t)) == pytest.approx(gini_value, abs=1e-12)
    assert float(entropy(t)) == pytest.approx(entropy_value, abs=1e-12)
    assert float(normalized_entropy(t)) == pytest.approx(entropy_value / math.log(len(counts)), abs=1e-12)
    fractions = load_fractions(t)
    assert fractions.tolist() == pytest.approx([c / sum(counts) for c in counts])


def test_matrix_rows_match_vectors_and_reference():
    g = torch.Generator().manual_seed(0)
    m = torch.randint(0, 50, (5, 16), generator=g)
    m[2] = 0
    m[2, 3] = 9  # a collapsed layer
    summary = load_summary(m)
    assert summary["fractions"].shape == (5, 16)
    for key in ("imbalance", "gini", "entropy", "entropy_norm"):
        assert summary[key].shape == (5,)
        for row in range(5):
            ref = ref_load_stats(m[row].tolist())[key]
            assert float(summary[key][row]) == pytest.approx(ref, rel=1e-12, abs=1e-12), (key, row)
    assert float(summary["gini"][2]) == pytest.approx(15 / 16)
    assert torch.allclose(summary["fractions"].sum(-1), torch.ones(5, dtype=torch.float64))


def test_scale_invariant_and_accepts_lists_and_numpy():
    counts = [7, 1, 3, 0, 2, 2]
    base = load_summary(counts)
    import numpy as np

    for other in (
        torch.tensor(counts) * 13,
        np.asarray(counts, dtype=np.int64),
        torch.tensor(counts).float(),
    ):
        summary = load_summary(other)
        for key in ("imbalance", "gini", "entropy", "entropy_norm"):
            assert float(summary[key]) == pytest.approx(float(base[key]), rel=1e-12)


def test_all_zero_counts_are_nan_not_balanced():
    zero = torch.zeros(4, dtype=torch.long)
    assert torch.equal(load_fractions(zero), torch.zeros(4, dtype=torch.float64))
    for fn in (max_mean_imbalance, gini, entropy, normalized_entropy):
        assert math.isnan(float(fn(zero))), fn.__name__
    m = torch.tensor([[0, 0, 0], [1, 1, 1]])
    g = gini(m)
    assert math.isnan(float(g[0])) and float(g[1]) == 0.0
    assert float(torch.nanmean(max_mean_imbalance(m))) == 1.0


def test_single_expert_and_validation():
    one = torch.tensor([5])
    assert float(gini(one)) == 0.0
    assert float(max_mean_imbalance(one)) == 1.0
    assert float(normalized_entropy(one)) == 1.0
    with pytest.raises(ValueError):
        gini(torch.tensor([1, -1, 2]))
    with pytest.raises(ValueError):
        gini(torch.zeros(2, 2, 2))
