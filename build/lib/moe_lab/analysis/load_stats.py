"""Expert-load statistics on routing counts.

Every function takes integer (or float) counts whose **last** dimension is the expert dimension: a
vector ``[E]`` (one layer) or a matrix ``[L, E]`` (one row per MoE layer), as a ``torch.Tensor``, a
NumPy array or a nested list. Results are float64 tensors with the expert dimension reduced away:
a 0-d tensor for a vector, ``[L]`` for a matrix.

All-zero rows (no token routed, e.g. a window without training steps) have no load distribution:
:func:`load_fractions` returns zeros for them and every statistic (:func:`max_mean_imbalance`,
:func:`gini`, :func:`entropy`, :func:`normalized_entropy`) returns ``nan``, so an empty window is never
mistaken for a balanced (or collapsed) one. Use ``torch.nanmean`` to average over layers.

Reference values for ``E = 4``: ``[1, 1, 1, 1]`` -> imbalance 1, Gini 0, entropy ``log 4``
(normalised 1); ``[4, 0, 0, 0]`` -> imbalance 4, Gini ``(E - 1) / E = 0.75``, entropy 0.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "entropy",
    "gini",
    "load_fractions",
    "load_summary",
    "max_mean_imbalance",
    "normalized_entropy",
]


def _as_counts(counts) -> torch.Tensor:
    t = torch.as_tensor(counts)
    if t.dim() not in (1, 2):
        raise ValueError(f"expected expert counts of shape [E] or [L, E], got shape {tuple(t.shape)}")
    if t.shape[-1] == 0:
        raise ValueError("expert counts have no expert dimension (E = 0)")
    t = t.detach().to(device="cpu", dtype=torch.float64)
    if (t < 0).any():
        raise ValueError("expert counts must be non-negative")
    return t


def _empty(t: torch.Tensor) -> torch.Tensor:
    return t.sum(-1) == 0


def load_fractions(counts) -> torch.Tensor:
    """Share of routed (token, slot) assignments per expert; rows sum to 1 (all-zero rows stay 0)."""
    t = _as_counts(counts)
    total = t.sum(-1, keepdim=True)
    return torch.where(total > 0, t / total.clamp_min(1e-300), torch.zeros_like(t))


def max_mean_imbalance(counts) -> torch.Tensor:
    """``max load / mean load``: 1 when perfectly balanced, ``E`` when everything goes to one expert."""
    t = _as_counts(counts)
    out = t.amax(-1) / t.mean(-1)
    return torch.where(_empty(t), torch.full_like(out, math.nan), out)


def gini(counts) -> torch.Tensor:
    """Gini coefficient of the loads, ``sum_ij |x_i - x_j| / (2 E^2 mean)``.

    0 = perfectly balanced, ``(E - 1) / E`` = all load on one expert (the population form, without the
    ``E / (E - 1)`` small-sample correction).
    """
    t = _as_counts(counts)
    e = t.shape[-1]
    x, _ = torch.sort(t, dim=-1)
    # sum_ij |x_i - x_j| = 2 * sum_i (2i - E + 1) x_(i) for ascending x, i = 0..E-1.
    rank = torch.arange(e, dtype=torch.float64)
    pair_sum = 2.0 * ((2.0 * rank - e + 1.0) * x).sum(-1)
    out = pair_sum / (2.0 * e * e * t.mean(-1))
    return torch.where(_empty(t), torch.full_like(out, math.nan), out)


def entropy(counts) -> torch.Tensor:
    """Shannon entropy (nats) of the load distribution: ``log E`` when balanced, 0 when collapsed."""
    t = _as_counts(counts)
    p = load_fractions(t)
    out = -torch.where(p > 0, p * torch.log(p.clamp_min(1e-300)), torch.zeros_like(p)).sum(-1)
    return torch.where(_empty(t), torch.full_like(out, math.nan), out)


def normalized_entropy(counts) -> torch.Tensor:
    """:func:`entropy` divided by ``log E`` (in [0, 1]; 1 = balanced). With a single expert it is 1."""
    t = _as_counts(counts)
    e = t.shape[-1]
    h = entropy(t)
    if e == 1:
        return torch.where(_empty(t), h, torch.ones_like(h))
    return h / math.log(e)


def load_summary(counts) -> dict[str, torch.Tensor]:
    """All statistics at once: ``fractions``, ``imbalance``, ``gini``, ``entropy``, ``entropy_norm``."""
    t = _as_counts(counts)
    return {
        "fractions": load_fractions(t),
        "imbalance": max_mean_imbalance(t),
        "gini": gini(t),
        "entropy": entropy(t),
        "entropy_norm": normalized_entropy(t),
    }
