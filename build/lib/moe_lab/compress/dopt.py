"""D-optimal expert selection (docs/specs/compression.md 2.3): kernel, lambda, greedy with incremental
Cholesky/Schur updates, and, for tests and the bench only, a naive greedy and brute force.

All computation in float64. Ties (within a relative 1e-10 of the best gain) go to the lower expert index.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

TIE_RTOL = 1e-10


@dataclass
class DOptResult:
    """Greedy output: ``order`` (experts in order of addition), ``gains`` [K] = log sigma at each addition
    (F(S_j) - F(S_{j-1})), and the ``lam`` used."""

    order: list[int]
    gains: torch.Tensor
    lam: float

    @property
    def objective(self) -> float:
        """F(S) = log det(K_S + lam I) of the selected set."""
        return float(self.gains.sum())


def kernel(importance: torch.Tensor, gram_hat: torch.Tensor) -> torch.Tensor:
    """K_ij = sqrt(I_i I_j) * G_ij (float64) from base importances I [E] >= 0 and the mean Gram G [E, E]."""
    root = importance.double().clamp_min(0).sqrt()
    return root[:, None] * gram_hat.double() * root[None, :]


def default_lambda(kern: torch.Tensor, K: int) -> float:
    """The paper's lambda = trace(K) / (K * E) (sum over all E experts)."""
    return float(kern.diagonal().sum()) / (K * kern.shape[0])


def _check(kern: torch.Tensor, K: int, lam: float | None) -> float:
    E = kern.shape[0]
    if kern.dim() != 2 or kern.shape[1] != E:
        raise ValueError(f"the D-optimal kernel must be square [E, E], got {tuple(kern.shape)}")
    if not 1 <= K <= E:
        raise ValueError(f"compress.K={K} must be between 1 and the number of experts {E}")
    lam = default_lambda(kern, K) if lam is None else float(lam)
    if not lam > 0 or not math.isfinite(lam):
        raise ValueError(
            f"D-optimal lambda={lam} is not positive: every kernel diagonal is zero (all base importances or "
            "expert outputs zero); use a non-DO score or set compress.do.lambda to a positive value"
        )
    return lam


def _first_max(values: torch.Tensor) -> int:
    """Lowest index whose value is within a relative TIE_RTOL of the maximum (-inf entries excluded)."""
    best = values.max()
    slack = TIE_RTOL * max(abs(float(best)), 1e-300)
    return int(torch.nonzero(values >= best - slack)[0])


def greedy(kern: torch.Tensor, K: int, lam: float | None = None) -> DOptResult:
    """Greedy maximisation of log det(K_S + lam I) over |S| = K (paper's Algorithm 2), O(E K^2): every
    candidate keeps its Cholesky row c_e and Schur complement sigma_e, updated once per addition."""
    kern = kern.double()
    lam = _check(kern, K, lam)
    E = kern.shape[0]
    sigma = kern.diagonal().clone() + lam
    rows = torch.zeros(E, K, dtype=torch.float64)
    free = torch.ones(E, dtype=torch.bool)
    order, gains = [], []
    floor = lam * (1 - 1e-12)
    for step in range(K):
        pick = _first_max(torch.where(free, sigma, torch.tensor(-math.inf, dtype=torch.float64)))
        order.append(pick)
        gains.append(math.log(float(sigma[pick])))
        free[pick] = False
        d = math.sqrt(float(sigma[pick]))
        gamma = (kern[pick] - rows[:, :step] @ rows[pick, :step]) / d
        rows[:, step] = gamma
        sigma = (sigma - gamma.square()).clamp_min(floor)
    return DOptResult(order, torch.tensor(gains, dtype=torch.float64), lam)


def objective(kern: torch.Tensor, subset, lam: float) -> float:
    """F(S) = log det(K_S + lam I) (0 for the empty set)."""
    idx = torch.as_tensor(list(subset), dtype=torch.long)
    if idx.numel() == 0:
        return 0.0
    sub = kern.double()[idx][:, idx] + lam * torch.eye(idx.numel(), dtype=torch.float64)
    return float(torch.linalg.slogdet(sub).logabsdet)


def naive_greedy(kern: torch.Tensor, K: int, lam: float | None = None) -> DOptResult:
    """Reference greedy recomputing log det(K_{S+e} + lam I) from scratch for every candidate (tests, bench)."""
    kern = kern.double()
    lam = _check(kern, K, lam)
    order: list[int] = []
    gains = []
    current = 0.0
    for _ in range(K):
        values = torch.full((kern.shape[0],), -math.inf, dtype=torch.float64)
        for e in range(kern.shape[0]):
            if e not in order:
                values[e] = objective(kern, order + [e], lam) - current
        pick = _first_max(values)
        order.append(pick)
        gains.append(float(values[pick]))
        current += gains[-1]
    return DOptResult(order, torch.tensor(gains, dtype=torch.float64), lam)


def brute_force(kern: torch.Tensor, K: int, lam: float | None = None) -> tuple[list[int], float]:
    """The exact maximiser of F over all K-subsets (lexicographically first on ties) and its value (tests)."""
    lam = _check(kern, K, lam)
    best, best_value = None, -math.inf
    for subset in itertools.combinations(range(kern.shape[0]), K):
        value = objective(kern, subset, lam)
        if value > best_value + TIE_RTOL * abs(best_value if math.isfinite(best_value) else 0.0):
            best, best_value = list(subset), value
    return best, best_value


def effective_rank(matrix: torch.Tensor) -> float:
    """Roy-Vetterli effective rank exp(-sum q log q), q = eigenvalues / their sum (negatives clamped to 0)."""
    eig = torch.linalg.eigvalsh(matrix.double()).clamp_min(0)
    total = eig.sum()
    if total <= 0:
        raise ValueError("effective rank of a zero matrix is undefined")
    q = eig / total
    q = q[q > 0]
    return float(torch.exp(-(q * q.log()).sum()))
