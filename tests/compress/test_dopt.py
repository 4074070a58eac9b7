"""D-optimal greedy selection (spec 2.3, oracle tests 2.15-10..13) on synthetic kernels, no model."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moe_lab.compress import dopt


def random_psd(E: int, rank: int | None = None, seed: int = 0, duplicates: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(E, rank or E, generator=gen, dtype=torch.float64)
    A = A * torch.empty(E, 1, dtype=torch.float64).uniform_(0.2, 3.0, generator=gen)
    for d in range(duplicates):  # exact duplicate columns of the kernel
        A[E - 1 - d] = A[d]
    return A @ A.T


def normalised(kern: torch.Tensor, subset, lam: float) -> float:
    """F~(S) = log det(I + K_S / lam), computed directly."""
    idx = torch.tensor(list(subset))
    return float(torch.logdet(torch.eye(len(idx), dtype=torch.float64) + kern[idx][:, idx] / lam))


CASES = [  # (E, K, rank, duplicates)
    (6, 3, None, 0), (10, 5, None, 0), (16, 8, None, 0), (16, 16, None, 0), (12, 6, 3, 0), (12, 7, 4, 2),
    (8, 4, None, 3), (16, 10, 5, 4),
]


@pytest.mark.parametrize("E,K,rank,dups", CASES)
def test_incremental_greedy_equals_naive(E, K, rank, dups):
    for seed in range(3):
        kern = random_psd(E, rank, seed, dups)
        fast, slow = dopt.greedy(kern, K), dopt.naive_greedy(kern, K)
        assert fast.order == slow.order
        torch.testing.assert_close(fast.gains, slow.gains, rtol=1e-9, atol=1e-9)
        assert fast.lam == slow.lam == pytest.approx(float(kern.trace()) / (K * E), rel=1e-15)
        assert math.isclose(fast.objective, dopt.objective(kern, fast.order, fast.lam), rel_tol=1e-9, abs_tol=1e-9)
        # sigma_e(S) >= lam: every gain >= log lam; diminishing returns: gains never increase along the greedy
        assert float(fast.gains.min()) >= math.log(fast.lam) - 1e-12
        assert bool((fast.gains[1:] <= fast.gains[:-1] + 1e-12).all())


def test_greedy_within_one_minus_one_over_e_of_brute_force():
    worst = 1.0
    for seed in range(40):
        E = 7 + seed % 6
        K = 2 + seed % 4
        kern = random_psd(E, rank=2 + seed % 5, seed=100 + seed)
        res = dopt.greedy(kern, K)
        best, best_value = dopt.brute_force(kern, K)
        greedy_tilde = normalised(kern, res.order, res.lam)
        best_tilde = normalised(kern, best, res.lam)
        assert math.isclose(best_value - K * math.log(res.lam), best_tilde, rel_tol=1e-9)
        assert greedy_tilde >= (1 - 1 / math.e) * best_tilde - 1e-9
        assert greedy_tilde <= best_tilde + 1e-9
        worst = min(worst, greedy_tilde / best_tilde)
    assert worst > 1 - 1 / math.e


def test_planted_duplicate_groups_one_expert_per_group():
    gen = torch.Generator().manual_seed(7)
    for case in range(60):
        G = 2 + case % 3
        sizes = torch.randint(1, 4, (G,), generator=gen).tolist()
        E = sum(sizes)
        basis = torch.linalg.qr(torch.randn(8, 8, generator=gen, dtype=torch.float64))[0]
        outputs, group_of = [], []
        for g, size in enumerate(sizes):
            for _ in range(size):
                outputs.append(basis[g] * torch.empty((), dtype=torch.float64).uniform_(1.0, 2.0, generator=gen))
                group_of.append(g)
        perm = torch.randperm(E, generator=gen)  # groups interleaved in expert order
        F = torch.stack(outputs)[perm]
        group_of = [group_of[i] for i in perm.tolist()]
        kern = dopt.kernel(torch.ones(E, dtype=torch.float64), F @ F.T)
        res = dopt.greedy(kern, G)
        best, _ = dopt.brute_force(kern, G)
        assert sorted(res.order) == best
        assert sorted(group_of[e] for e in res.order) == list(range(G))


def test_diagonal_kernel_selects_top_k_by_diagonal():
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        diag = torch.rand(9, generator=gen, dtype=torch.float64) + 0.01
        kern = torch.diag(diag)
        for K in (1, 3, 5):
            res = dopt.greedy(kern, K)
            top = torch.sort(-diag, stable=True).indices[:K].tolist()
            assert res.order == top
            assert dopt.brute_force(kern, K)[0] == sorted(top)


def test_incoherence_bound_thm_3_2():
    gen = torch.Generator().manual_seed(11)
    checked = 0
    for _ in range(30):
        E, K = 9, 3
        A = torch.eye(E, dtype=torch.float64) + 0.05 * torch.randn(E, E, generator=gen, dtype=torch.float64)
        scale = torch.rand(E, generator=gen, dtype=torch.float64) + 0.5
        kern = scale[:, None] * (A @ A.T) * scale[None, :]
        d = kern.diagonal().sqrt()
        coh = (kern / (d[:, None] * d[None, :])).fill_diagonal_(0).abs().max().item()
        if (K - 1) * coh >= 1:
            continue
        lam = dopt.default_lambda(kern, K)
        diag_set = torch.sort(-kern.diagonal(), stable=True).indices[:K].tolist()
        _, best = dopt.brute_force(kern, K)
        bound = K * math.log((1 + (K - 1) * coh) / (1 - (K - 1) * coh))
        assert dopt.objective(kern, diag_set, lam) >= best - bound - 1e-12
        checked += 1
    assert checked >= 20


def _redundancy_kernel(K: int):
    """[P2] Thm 3.1: E = 2K-1 scalar experts on 2K-1 equiprobable points; ACP kernel with CP = 1."""
    E = 2 * K - 1
    points = E
    F = torch.zeros(E, points, dtype=torch.float64)  # F[e, x] = f_e(x); points 0..K-1 are a_j, K.. are b_j
    F[:K, :K] = 1.0
    for j in range(K - 1):
        F[K + j, K + j] = 1.0
    gram_hat = F @ F.T / points
    acp = gram_hat.diagonal().sqrt()  # CP = 1
    return F, dopt.kernel(acp, gram_hat), acp


def _reconstruction_error(F: torch.Tensor, subset) -> float:
    """min_c mean_x (1 - sum_e c_e f_e(x))^2 over the uniform points."""
    X = F[list(subset)].T
    target = torch.ones(F.shape[1], 1, dtype=torch.float64)
    coef = torch.linalg.lstsq(X, target).solution
    return float(((target - X @ coef) ** 2).mean())


@pytest.mark.parametrize("K", [2, 3, 4, 5])
def test_redundancy_counterexample(K):
    F, kern, acp = _redundancy_kernel(K)
    E = 2 * K - 1
    assert torch.allclose(acp[:K], torch.full((K,), math.sqrt(K / E), dtype=torch.float64))
    assert torch.allclose(acp[K:], torch.full((K - 1,), math.sqrt(1 / E), dtype=torch.float64))
    top = torch.sort(-acp, stable=True).indices[:K].tolist()
    assert top == list(range(K))
    assert math.isclose(_reconstruction_error(F, top), (K - 1) / E, rel_tol=1e-9)
    beta = E ** -1.5
    res = dopt.greedy(kern, K, lam=beta)
    best, _ = dopt.brute_force(kern, K, lam=beta)
    expected = [0] + list(range(K, E))
    assert sorted(res.order) == best == expected
    assert _reconstruction_error(F, res.order) < 1e-20
    # the caveat of the spec: with the paper's default lambda the maximiser keeps 1 duplicate for K <= 3, 2 above
    default_best, _ = dopt.brute_force(kern, K)
    assert sum(e < K for e in default_best) == (1 if K <= 3 else 2)


def test_invariances_scaling_and_relabelling():
    gen = torch.Generator().manual_seed(5)
    E, K = 12, 5
    outputs = torch.randn(E, 20, generator=gen, dtype=torch.float64)
    importance = torch.rand(E, generator=gen, dtype=torch.float64) + 0.1
    base = dopt.greedy(dopt.kernel(importance, outputs @ outputs.T), K).order
    assert dopt.greedy(dopt.kernel(3.7 * importance, outputs @ outputs.T), K).order == base
    scaled = -2.5 * outputs
    assert dopt.greedy(dopt.kernel(importance, scaled @ scaled.T), K).order == base
    assert dopt.greedy(dopt.kernel(importance, 0.01 * outputs @ outputs.T), K).order == base
    perm = torch.randperm(E, generator=gen)
    relabelled = dopt.greedy(dopt.kernel(importance[perm], (outputs @ outputs.T)[perm][:, perm]), K).order
    assert [int(perm[e]) for e in relabelled] == base


def test_fixed_lambda_greedy_is_nested_default_lambda_need_not_be():
    kern = random_psd(14, seed=21)
    lam = 0.3
    full = dopt.greedy(kern, 10, lam=lam).order
    for K in range(1, 10):
        assert dopt.greedy(kern, K, lam=lam).order == full[:K]


def test_effective_rank():
    assert dopt.effective_rank(torch.eye(6)) == pytest.approx(6.0, rel=1e-12)
    v = torch.randn(5, 1, dtype=torch.float64)
    assert dopt.effective_rank(v @ v.T) == pytest.approx(1.0, rel=1e-9)
    eig = torch.tensor([3.0, 1.0], dtype=torch.float64)
    q = eig / eig.sum()
    assert dopt.effective_rank(torch.diag(eig)) == pytest.approx(math.exp(-(q * q.log()).sum().item()), rel=1e-12)
    r = dopt.effective_rank(random_psd(8, rank=4, seed=2))
    assert 1.0 <= r <= 4.0 + 1e-9


def test_bad_input():
    with pytest.raises(ValueError, match="lambda=0.0 is not positive"):
        dopt.greedy(torch.zeros(4, 4), 2)
    with pytest.raises(ValueError, match="compress.K=5 must be between 1 and the number of experts 4"):
        dopt.greedy(torch.eye(4), 5)
    with pytest.raises(ValueError, match="square"):
        dopt.greedy(torch.ones(3, 4), 2)


def test_brute_force_is_exhaustive():
    kern = random_psd(7, seed=4)
    lam = 0.5
    best, value = dopt.brute_force(kern, 3, lam=lam)
    values = {s: dopt.objective(kern, s, lam) for s in itertools.combinations(range(7), 3)}
    assert max(values.values()) == value and values[tuple(best)] == value
