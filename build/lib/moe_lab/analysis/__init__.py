"""Analysis of routing and training: load statistics (:mod:`.load_stats`) and PNG plots (:mod:`.plots`).

The plotting functions are imported lazily so that ``import moe_lab.analysis`` does not load matplotlib.
"""

from .load_stats import (
    entropy,
    gini,
    load_fractions,
    load_summary,
    max_mean_imbalance,
    normalized_entropy,
)

_PLOTS = ("expert_load_heatmap", "loss_curve", "read_metric_csv")

__all__ = [
    "entropy",
    "expert_load_heatmap",
    "gini",
    "load_fractions",
    "load_summary",
    "loss_curve",
    "max_mean_imbalance",
    "normalized_entropy",
    "read_metric_csv",
]


def __getattr__(name: str):
    if name in _PLOTS:
        from . import plots

        return getattr(plots, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
