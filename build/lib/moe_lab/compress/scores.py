"""Expert scores from calibration statistics (docs/specs/compression.md 2.2, 4.1) and top-K / D-optimal selection.

``scores(calibration, method, **kw) -> {layer: float64 [E]}``; ``select_experts(calibration, method, K, **kw)
-> {layer: int64 [K]}`` in ranked order (D-optimal methods: the greedy's addition order).
Methods: sf, pp, ps, cp, acp, do_cp, do_acp, reap, ean_mean (alias ean), ean_sum, es_act, es_mag, random.
The EAN pair is REAP's (its public code): ``ean_mean`` = norm_sel / count, ``ean_sum`` = norm_sel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import dopt
from .calibration import Calibration


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den with 0 where den == 0 (never-selected experts)."""
    den = den.double()
    return torch.where(den > 0, num.double() / den.clamp_min(1e-300), torch.zeros_like(num, dtype=torch.float64))


def _n(stats) -> float:
    n = int(stats["n"])
    if n <= 0:
        raise ValueError("the calibration file has a layer with no real tokens (n = 0): recalibrate with more data")
    return float(n)


def _sf(stats, top_k, **_):
    return stats["count"].double() / _n(stats)


def _pp(stats, top_k, **_):
    return stats["p_sum"].double() / _n(stats)


def _ps(stats, top_k, **_):
    return stats["p_sel"].double() / _n(stats)


def _cp(stats, top_k, **_):
    return _safe_div(stats["p_sel"], stats["count"])


def mean_sq_norm(stats) -> torch.Tensor:
    """v_e = sq_norm / n: mean squared output norm over ALL calibration tokens."""
    return stats["sq_norm"].double() / _n(stats)


def _acp(stats, top_k, **_):
    return _cp(stats, top_k) * mean_sq_norm(stats).sqrt()


def _reap(stats, top_k, **_):
    return _safe_div(stats["wnorm_sel"], stats["count"])


def _ean_mean(stats, top_k, **_):
    """REAP's ``ean_mean``: mean ||f_e|| over the tokens routed to e (0 if never routed)."""
    return _safe_div(stats["norm_sel"], stats["count"])


def _ean_sum(stats, top_k, **_):
    """REAP's ``ean_sum``: sum of ||f_e|| over the tokens routed to e (favours frequently routed experts)."""
    return stats["norm_sel"].double()


def _num_seqs(stats) -> float:
    s = int(stats["num_seqs"])
    if s <= 0:
        raise ValueError("the calibration file has a layer with no sequences (num_seqs = 0): recalibrate")
    return float(s)


def _es_act(stats, top_k, **_):
    return stats["seq_act"].double() / (_num_seqs(stats) * top_k)


def _es_mag(stats, top_k, variant="gated", **_):
    return stats[_ES_MAG_STAT[variant]].double() / _num_seqs(stats)


_ES_MAG_STAT = {"gated": "seq_mag", "ungated": "seq_mag_ungated"}

# method -> (score function, statistics it reads); DO methods score by their base importance
METHODS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "sf": (_sf, ("n", "count")),
    "pp": (_pp, ("n", "p_sum")),
    "ps": (_ps, ("n", "p_sel")),
    "cp": (_cp, ("count", "p_sel")),
    "acp": (_acp, ("n", "count", "p_sel", "sq_norm")),
    "do_cp": (_cp, ("n", "count", "p_sel", "gram")),
    "do_acp": (_acp, ("n", "count", "p_sel", "sq_norm", "gram")),
    "reap": (_reap, ("count", "wnorm_sel")),
    "ean": (_ean_mean, ("count", "norm_sel")),  # = ean_mean (the earlier name)
    "ean_mean": (_ean_mean, ("count", "norm_sel")),
    "ean_sum": (_ean_sum, ("norm_sel",)),
    "es_act": (_es_act, ("seq_act", "num_seqs")),
    "es_mag": (_es_mag, ("num_seqs",)),
    "random": (None, ()),
}
DOPT_METHODS = ("do_cp", "do_acp")


def _method(method: str):
    if method not in METHODS:
        raise ValueError(f"unknown score {method!r} (compress.score): choose one of {', '.join(METHODS)}")
    return METHODS[method]


def _random_scores(calibration: Calibration, seed: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(int(seed))
    out = {}
    E = int(calibration.manifest["num_experts"])
    for layer in calibration.layers:
        perm = torch.randperm(E, generator=gen)
        score = torch.empty(E, dtype=torch.float64)
        score[perm] = (E - torch.arange(E, dtype=torch.float64)) / E
        out[layer] = score
    return out


def _refuse_output_gated(calibration: Calibration, method: str, variant: str) -> None:
    """Refuse by name a score read from router-weighted output norms (REAP, gated ES-Mag) where the calibrated
    family's routing weight scales the expert input (``moe_lab.moe.support``)."""
    from ..moe.registry import FAMILIES
    from ..moe.support import refuse_undefined

    spec = FAMILIES.get(calibration.manifest.get("model_type"))
    if spec is not None and (method == "reap" or (method == "es_mag" and variant == "gated")):
        refuse_undefined(method, spec, None)


def scores(calibration: Calibration, method: str, *, seed: int = 0, variant: str = "gated"
           ) -> dict[int, torch.Tensor]:
    """Per-layer expert scores (float64 [E], >= 0) of ``method``; DO-CP / DO-ACP give their base importance
    (CP / ACP). ``seed``: random; ``variant``: es_mag ``gated`` (||w_e f_e||, default) or ``ungated``."""
    fn, needs = _method(method)
    _refuse_output_gated(calibration, method, variant)
    if method == "random":
        return _random_scores(calibration, seed)
    if method == "es_mag":
        if variant not in _ES_MAG_STAT:
            raise ValueError(f"es_mag variant={variant!r}: choose one of {', '.join(_ES_MAG_STAT)}")
        needs = needs + (_ES_MAG_STAT[variant],)
    calibration.require(*needs, score=method)
    top_k = int(calibration.manifest["top_k"])
    return {layer: fn(stats, top_k, variant=variant) for layer, stats in calibration.layers.items()}


def ranking(score: torch.Tensor) -> torch.Tensor:
    """Experts by descending score, ties to the lower index (stable sort on the negated score)."""
    return torch.sort(-score.double(), stable=True).indices


def dopt_kernel(stats: dict, importance: torch.Tensor) -> torch.Tensor:
    """The D-optimal kernel of one layer: sqrt(I_i I_j) * gram_ij / n."""
    return dopt.kernel(importance, stats["gram"].double() / _n(stats))


def select_experts(calibration: Calibration, method: str, K: int, *, lam: float | str | None = "auto",
                   seed: int = 0, variant: str = "gated") -> dict[int, torch.Tensor]:
    """The K experts kept per layer (int64 [K], in order): top-K by score with ties to the lower index, or
    for do_cp / do_acp the D-optimal greedy's addition order (``lam``: "auto" = the paper's lambda, or a
    float)."""
    E = int(calibration.manifest["num_experts"])
    if not 1 <= int(K) <= E:
        raise ValueError(f"compress.K={K} must be between 1 and num_experts={E}")
    base = scores(calibration, method, seed=seed, variant=variant)
    if method not in DOPT_METHODS:
        return {layer: ranking(s)[: int(K)] for layer, s in base.items()}
    fixed = None if lam in (None, "auto") else float(lam)
    out = {}
    for layer, importance in base.items():
        result = dopt.greedy(dopt_kernel(calibration.layers[layer], importance), int(K), fixed)
        out[layer] = torch.tensor(result.order, dtype=torch.long)
    return out
