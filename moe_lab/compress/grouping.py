"""Top-K selection and grouping of the selected experts into k groups (docs/specs/compression.md 2.4-2.5).

Pure functions on router rows, expert weights and the calibration Gram matrix. The selected experts come
as a *ranked* list (best first: score order, or the D-optimal greedy order when asked for). Every grouping
returns exactly ``k`` non-empty groups (lists of expert ids) ordered by their best member's rank; inside a
group members keep the rank order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GROUPINGS = ("rr", "wc", "rc", "ab", "oc")


def rank(scores: torch.Tensor, experts: Sequence[int] | None = None) -> list[int]:
    """``experts`` (default: all) by descending score, ties -> lower expert id (stable sort)."""
    ids = list(range(len(scores))) if experts is None else sorted(int(e) for e in experts)
    values = scores.detach().double().cpu()[ids]
    order = torch.sort(-values, stable=True).indices.tolist()
    return [ids[i] for i in order]


def top_k(scores: torch.Tensor, K: int) -> list[int]:
    """The ``K`` highest-scoring experts in ranked order (spec 2.4)."""
    if not 1 <= K <= len(scores):
        raise ValueError(f"K={K} must be between 1 and the number of experts ({len(scores)})")
    return rank(scores)[:K]


def feature_gram(*features: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """fp64 Gram matrix [n, n] of the rows of the concatenation of ``features`` (each [n, ...]), accumulated over
    ``chunk`` columns at a time (WC features have 3*H*I columns per expert; nothing is concatenated)."""
    n = len(features[0])
    gram = torch.zeros(n, n, dtype=torch.float64, device=features[0].device)
    for f in features:
        f = f.detach().reshape(n, -1)
        for start in range(0, f.shape[1], chunk):
            part = f[:, start:start + chunk].double()
            gram += part @ part.T
    return gram


def cosine_distance(*features: torch.Tensor) -> torch.Tensor:
    """``1 - cos(f_i, f_j)`` (fp64) for the rows of (the concatenation of) ``features``; a zero row has cosine 0."""
    return correlation_distance(feature_gram(*features)).clamp_min(0.0)


def correlation_distance(gram: torch.Tensor) -> torch.Tensor:
    """Output-correlation distance ``1 - G_ij / sqrt(G_ii G_jj)`` (0 correlation where a diagonal is 0)."""
    g = gram.detach().double()
    diag = g.diagonal()
    denom = (diag[:, None] * diag[None, :]).sqrt()
    rho = torch.where(denom > 0, g / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(g))
    rho.fill_diagonal_(1.0)
    return 1.0 - rho


def agglomerative(distance: torch.Tensor, k: int, labels: Sequence[int] | None = None) -> list[list[int]]:
    """Average-linkage agglomerative clustering of ``n`` items to exactly ``k`` clusters (spec 2.5).

    Repeatedly merges the pair of clusters with the smallest mean pairwise distance; ties -> the pair
    whose smallest member labels are lexicographically smallest. ``labels`` name the items (default
    0..n-1). Returns clusters as sorted label lists, in order of their smallest label.
    """
    n = distance.shape[0]
    labels = list(range(n)) if labels is None else [int(x) for x in labels]
    if not 1 <= k <= n:
        raise ValueError(f"cannot form k={k} clusters from {n} items")
    d = distance.detach().double().cpu().clone()
    d = (d + d.T) / 2
    members = {i: [labels[i]] for i in range(n)}
    active = torch.ones(n, dtype=torch.bool)
    while len(members) > k:
        pair_ok = active[:, None] & active[None, :]
        pair_ok &= torch.ones(n, n, dtype=torch.bool).triu(1)
        masked = torch.where(pair_ok, d, torch.full_like(d, float("inf")))
        best = masked.min()
        rows, cols = torch.nonzero(masked == best, as_tuple=True)
        candidates = [
            (tuple(sorted((min(members[a]), min(members[b])))), a, b) for a, b in zip(rows.tolist(), cols.tolist())
        ]
        _, a, b = min(candidates)
        na, nb = len(members[a]), len(members[b])
        d[a] = (na * d[a] + nb * d[b]) / (na + nb)  # Lance-Williams update for average linkage
        d[:, a] = d[a]
        members[a] = sorted(members[a] + members.pop(b))
        active[b] = False
    return sorted(members.values(), key=min)


def _order(groups: list[list[int]], ranked: list[int]) -> list[list[int]]:
    position = {e: i for i, e in enumerate(ranked)}
    groups = [sorted(g, key=position.__getitem__) for g in groups]
    return sorted(groups, key=lambda g: position[g[0]])


def round_robin(ranked: Sequence[int], k: int) -> list[list[int]]:
    """RR: the expert of 0-based rank r goes to group r mod k."""
    ranked = list(ranked)
    return [ranked[g::k] for g in range(k)]


def anchor_based(ranked: Sequence[int], k: int, router_weight: torch.Tensor) -> list[list[int]]:
    """AB: the k best-ranked experts anchor one group each; every other selected expert joins the anchor
    with the highest router-row cosine similarity (ties -> lower anchor id)."""
    ranked = list(ranked)
    anchors = sorted(ranked[:k])
    groups = {a: [a] for a in anchors}
    if len(ranked) > k:
        rest = ranked[k:]
        sim = 1.0 - cosine_distance(router_weight[anchors + rest])[len(anchors):, : len(anchors)]
        for row, e in enumerate(rest):
            best = sim[row].max()
            groups[anchors[int(torch.nonzero(sim[row] == best)[0])]].append(e)
    return list(groups.values())


def _clustered(distance: torch.Tensor, selected: Sequence[int], k: int) -> list[list[int]]:
    ids = sorted(int(e) for e in selected)
    return agglomerative(distance[ids][:, ids], k, labels=ids)


def group_experts(
    method: str,
    ranked: Sequence[int],
    k: int,
    *,
    router_weight: torch.Tensor | None = None,
    expert_features: torch.Tensor | Sequence[torch.Tensor] | None = None,
    gram: torch.Tensor | None = None,
    distance: torch.Tensor | None = None,
) -> list[list[int]]:
    """Partition the ranked selected experts into ``k`` groups by ``method`` (rr | wc | rc | ab | oc).

    ranked: selected expert ids, best first (RR order, AB anchors, group order). router_weight [E, H]: RC/AB.
    expert_features [E, ...] (or several, concatenated per expert): WC's (gate, up, down) weights. gram [E, E]: OC. distance [E, E]: the clustering
    distance of wc / rc / oc precomputed over all experts (see :func:`clustering_distance`).
    """
    selected = [int(e) for e in ranked]
    if len(set(selected)) != len(selected):
        raise ValueError(f"selected experts contain duplicates: {selected}")
    if not 1 <= k <= len(selected):
        raise ValueError(f"cannot form k={k} groups from K={len(selected)} selected experts: need K >= k")
    if method == "rr":
        groups = round_robin(selected, k)
    elif method == "ab":
        groups = anchor_based(selected, k, _need(router_weight, "router_weight", method))
    elif method in ("wc", "rc", "oc"):
        if distance is None:
            distance = clustering_distance(method, router_weight=router_weight, expert_features=expert_features,
                                           gram=gram)
        groups = _clustered(distance, selected, k)
    else:
        raise ValueError(f"compress.grouping={method!r}: choose one of {', '.join(GROUPINGS)}")
    return _order(groups, selected)


def clustering_distance(method: str, *, router_weight: torch.Tensor | None = None,
                        expert_features: torch.Tensor | Sequence[torch.Tensor] | None = None,
                        gram: torch.Tensor | None = None) -> torch.Tensor:
    """The [E, E] distance that wc (weight cosine), rc (router-row cosine) or oc (output correlation) clusters;
    a subset's distances are its submatrix, so one matrix per layer serves every K and score."""
    if method == "wc":
        feats = _need(expert_features, "expert_features", method)
        return cosine_distance(*(feats if isinstance(feats, (tuple, list)) else (feats,)))
    if method == "rc":
        return cosine_distance(_need(router_weight, "router_weight", method))
    if method == "oc":
        return correlation_distance(_need(gram, "gram", method))
    raise ValueError(f"grouping {method!r} is not a clustering (wc | rc | oc)")


def _need(value, name: str, method: str):
    if value is None:
        raise ValueError(f"grouping {method!r} needs {name}")
    return value
