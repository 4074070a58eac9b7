"""Evaluation: answer extraction, answer formats, evaluation sets, scoring and results tables.

Text side (no model needed): ``answers`` (math answers), ``choices`` (commonsense formats),
``eval_sets`` (registry and loading), ``score`` (scoring + ``python -m moe_lab.eval.score``), ``results``
(tables). Model side: ``generation``, ``likelihood``, ``perplexity``, ``lm_eval_bridge``.
"""

from .eval_sets import EVAL_SETS, GROUPS, get_eval_set, load_eval_set, resolve
from .results import ResultsTable
from .score import score_predictions

__all__ = ["EVAL_SETS", "GROUPS", "ResultsTable", "get_eval_set", "load_eval_set", "resolve", "score_predictions"]
