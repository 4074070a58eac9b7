"""Metric and filter of the ``humaneval_pass10`` lm-eval task (resolved by lm-eval from the YAML beside it).

pass@k is the unbiased estimator of Chen et al. 2021, ``1 - C(n-c, k) / C(n, k)`` per problem (n samples, c of
them correct) averaged over problems, in its numerically stable product form: the function lm-eval ships
(``lm_eval.tasks.cruxeval.utils._pass_at_k``), which is HF ``code_eval``'s ``estimate_pass_at_k`` (the metric
behind lm-eval's own ``humaneval``). Each program (completion + "\\n" + the test, as ``code_eval`` builds it) runs
in lm-eval's bundled human-eval sandbox (a child process, 3 s limit, destructive calls disabled), so no hub
metric is needed; lm-eval runs the task only with ``confirm_run_unsafe_code=True``.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from lm_eval.tasks.cruxeval.utils import _pass_at_k, check_correctness

TIMEOUT_S = 3.0  # HF code_eval's default per program
WORKERS = 4  # HF code_eval's default


def estimate_pass_at_k(correct: list[list[bool]], k: int) -> float:
    """Mean over problems of the unbiased pass@k from each problem's per-sample correctness."""
    short = [len(c) for c in correct if len(c) < k]
    if short:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {min(short)}: raise the task's "
                         f"`repeats` (humaneval_pass10.yaml) to >= {k}")
    return float(np.mean([_pass_at_k(len(c), int(sum(c)), k) for c in correct]))


def pass_at_k(references: list[str], predictions: list[list[str]], k: int | list[int] = (1,)) -> dict[str, float]:
    """``{"pass@<k>": value}``: run every candidate program against its problem's test, then estimate."""
    ks = [k] if isinstance(k, int) else list(k)
    run = functools.partial(check_correctness, timeout=TIMEOUT_S)
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        correct = [list(pool.map(run, [c + "\n" + test for c in candidates]))
                   for test, candidates in zip(references, predictions)]
    return {f"pass@{kk}": estimate_pass_at_k(correct, kk) for kk in ks}


def build_predictions(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """Prompt + completion per sample (lm-eval's humaneval ``utils.build_predictions``; that module loads the hub
    ``code_eval`` metric on import, so it is not imported here)."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs)]
