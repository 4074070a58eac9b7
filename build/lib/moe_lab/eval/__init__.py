"""Evaluation: answer extraction, answer formats, evaluation sets, scoring and results tables.

Text side (no model needed): ``answers`` (math answers), ``choices`` (commonsense formats),
``eval_sets`` (registry and loading), ``score`` (scoring; ``python -m moe_lab.eval.score``), ``results``
(tables; ``python -m moe_lab.eval.results``). Model side: ``generation``, ``likelihood``, ``perplexity``,
``lm_eval_bridge``. Nothing is imported here, so the ``-m`` entry points run without warnings.
"""
