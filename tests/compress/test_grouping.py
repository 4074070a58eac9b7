"""Grouping (spec 2.5, oracle tests 2.15-4/14/15): scipy cross-check, planted partitions, RR/AB structure."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.cluster.hierarchy import cut_tree, linkage
from scipy.spatial.distance import squareform

from moe_lab.compress.grouping import (
    GROUPINGS,
    agglomerative,
    clustering_distance,
    correlation_distance,
    cosine_distance,
    feature_gram,
    group_experts,
    rank,
    top_k,
)


def _partition(groups):
    return sorted(tuple(sorted(g)) for g in groups)


@pytest.mark.parametrize("seed", range(6))
def test_agglomerative_matches_scipy_average_linkage(seed):
    gen = torch.Generator().manual_seed(seed)
    points = torch.randn(11, 5, generator=gen, dtype=torch.float64)
    dist = torch.cdist(points, points)
    for k in (1, 2, 3, 5, 11):
        ours = agglomerative(dist, k)
        z = linkage(squareform(dist.numpy(), checks=False), method="average")
        labels = cut_tree(z, n_clusters=k).ravel()
        theirs = [list(np.nonzero(labels == c)[0]) for c in np.unique(labels)]
        assert len(ours) == k
        assert _partition(ours) == _partition(theirs)


def test_agglomerative_ties_give_exactly_k_clusters_deterministically():
    dist = torch.zeros(6, 6, dtype=torch.float64)  # all points identical: every pair ties
    groups = agglomerative(dist, 3, labels=[10, 11, 12, 13, 14, 15])
    # ties -> lexicographically smallest (min label) pair: 10+11, then {10,11}+12, then +13
    assert groups == [[10, 11, 12, 13], [14], [15]]


def test_average_linkage_uses_mean_pairwise_distance():
    # a-b close; c is at distance 1.0 from a and 3.0 from b (mean 2.0); d at 1.9 from both (mean 1.9)
    d = torch.tensor([[0, .1, 1., 1.9], [.1, 0, 3., 1.9], [1., 3., 0, 5.], [1.9, 1.9, 5., 0]], dtype=torch.float64)
    assert agglomerative(d, 2) == [[0, 1, 3], [2]]  # single linkage would attach c (distance 1.0) instead


def test_oc_recovers_planted_partition():
    """Thm F.2: within-group dissimilarity below every between-group one -> OC returns the planted groups."""
    gen = torch.Generator().manual_seed(3)
    planted = [[0, 4, 7], [1, 2], [3, 5, 6, 8]]
    base = torch.linalg.qr(torch.randn(32, 3, generator=gen, dtype=torch.float64))[0].T  # orthonormal
    outputs = torch.zeros(9, 32, dtype=torch.float64)
    for g, members in enumerate(planted):
        for e in members:
            outputs[e] = (1 + torch.rand((), generator=gen)) * (base[g] + 0.05 * torch.randn(32, generator=gen))
    gram = outputs @ outputs.T
    ranked = list(range(9))
    assert _partition(group_experts("oc", ranked, 3, gram=gram)) == _partition(planted)
    rho = 1 - correlation_distance(gram)
    assert torch.allclose(rho.diagonal(), torch.ones(9, dtype=torch.float64)) and bool((rho.abs() <= 1 + 1e-12).all())


def test_round_robin_structure():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(16, generator=gen)
    for K, k in ((8, 3), (12, 4), (7, 7), (16, 5)):
        ranked = top_k(scores, K)
        groups = group_experts("rr", ranked, k)
        assert len(groups) == k and max(map(len, groups)) - min(map(len, groups)) <= 1
        for r, e in enumerate(ranked):
            assert e in groups[r % k]


def test_anchor_based_structure_against_brute_force():
    gen = torch.Generator().manual_seed(1)
    router = torch.randn(12, 6, generator=gen)
    scores = torch.rand(12, generator=gen)
    ranked, k = top_k(scores, 9), 3
    groups = group_experts("ab", ranked, k, router_weight=router)
    anchors = ranked[:k]
    assert sorted(g[0] for g in groups) == sorted(anchors)
    for g in groups:
        for e in g[1:]:
            cos = [float(torch.nn.functional.cosine_similarity(router[e], router[a], dim=0)) for a in anchors]
            assert g[0] == anchors[int(np.argmax(cos))]


def test_rank_ties_go_to_lower_index_and_top_k_bounds():
    s = torch.tensor([0.5, 0.9, 0.5, 0.9, 0.1])
    assert rank(s) == [1, 3, 0, 2, 4]
    assert top_k(s, 3) == [1, 3, 0]
    with pytest.raises(ValueError, match="K=6"):
        top_k(s, 6)


def _inputs(E=10, H=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=gen)
    weights = torch.randn(E, 40, generator=gen)
    out = torch.randn(E, 30, generator=gen, dtype=torch.float64)
    return {"router_weight": router, "expert_features": weights, "gram": out @ out.T}


def test_every_grouping_returns_k_groups_and_singletons_at_K_equal_k():
    extra = _inputs()
    ranked = [7, 2, 9, 0, 4, 5]
    for method in GROUPINGS:
        for k in (1, 2, 4, 6):
            groups = group_experts(method, ranked, k, **extra)
            assert len(groups) == k and all(groups)
            assert sorted(itertools.chain(*groups)) == sorted(ranked)
            position = [ranked.index(g[0]) for g in groups]
            assert position == sorted(position)  # ordered by best member
        assert group_experts(method, ranked, 6, **extra) == [[e] for e in ranked]


def test_grouping_errors_name_the_fix():
    with pytest.raises(ValueError, match="need K >= k"):
        group_experts("rr", [0, 1], 3)
    with pytest.raises(ValueError, match="compress.grouping='xx'"):
        group_experts("xx", [0, 1, 2], 2)
    with pytest.raises(ValueError, match="needs gram"):
        group_experts("oc", [0, 1, 2], 2)


def test_feature_gram_chunks_and_concatenation_against_a_direct_product():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 5, 7, generator=gen), torch.randn(6, 3, generator=gen)
    direct = torch.cat([a.reshape(6, -1), b], dim=1).double()
    assert torch.allclose(feature_gram(a, b, chunk=4), direct @ direct.T, rtol=1e-12, atol=1e-12)
    cos = torch.nn.functional.cosine_similarity(direct[:, None], direct[None], dim=-1)
    assert torch.allclose(cosine_distance(a, b), 1 - cos, rtol=0, atol=1e-12)
    # a subset's clustering uses the submatrix of the full distance: the same as clustering the subset alone
    ids = [5, 1, 3, 0]
    full = clustering_distance("wc", expert_features=(a, b))
    alone = agglomerative(cosine_distance(a[sorted(ids)], b[sorted(ids)]), 2, labels=sorted(ids))
    assert _partition(group_experts("wc", ids, 2, distance=full)) == _partition(alone)


def test_cosine_distance_zero_row():
    f = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 0.0]])
    d = cosine_distance(f)
    assert d[0, 2] == 0 and d[0, 1] == 1 and d[1, 1] == 0
