"""lm-evaluation-harness on a moe-lab model (in memory or an exported checkpoint), offline.

The task definitions in ``lm_eval_tasks/`` read the LLM-Adapters test files: multiple choice for boolq,
piqa, social_iqa, winogrande, arc_easy, arc_challenge, openbookqa (tag ``llm_adapters_commonsense``) and
generation for gsm8k, svamp, multiarith, addsub, aqua, singleeq, mawps (tag ``llm_adapters_math``). The
same folder works on the lm-eval command line::

    lm_eval --model hf --model_args pretrained=out/export --include_path moe_lab/eval/lm_eval_tasks \\
        --tasks boolq,social_iqa --metadata '{"data_dir": "../shared/data/llm_adapters"}'

but only :func:`evaluate_with_lm_eval` (:func:`lm_eval_model`) re-installs the moe-lab routing an export
carries beside its vanilla weights (Expert Condenser, Compressed Experts); the command line evaluates
such an export with vanilla HF routing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from moe_lab.eval.eval_sets import data_dir as resolve_data_dir
from moe_lab.eval.likelihood import eval_mode

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TAGS = ("llm_adapters_commonsense", "llm_adapters_math")


def local_tasks() -> list[str]:
    """Names of the task definitions shipped in ``lm_eval_tasks/``."""
    return sorted(p.stem for p in TASK_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def evaluate_with_lm_eval(
    model_or_path: torch.nn.Module | str | os.PathLike,
    tokenizer: Any = None,
    tasks: list[str] = ("llm_adapters_commonsense",),
    *,
    limit: float | None = None,
    batch_size: int = 16,
    data_dir: str | os.PathLike | None = None,
    num_fewshot: int | None = None,
    max_length: int | None = None,
    device: str | None = None,
    hub_tasks: bool = False,
    **simple_evaluate_kwargs: Any,
) -> dict:
    """Run ``lm_eval.simple_evaluate`` and return its result dict (``result["results"][task]["acc,none"]``;
    ``lm_eval_metrics`` flattens it).

    ``model_or_path``: an HF model object (vanilla or patched by ``moe_lab.apply``; it is evaluated in eval
    mode and its mode restored) or an exported checkpoint directory (``patch.export(dir, tokenizer)``).
    ``tokenizer`` defaults to the checkpoint's. Tasks come from ``lm_eval_tasks/`` over the LLM-Adapters
    files in ``data_dir`` (default ``$MOE_LAB_DATA_DIR`` or ``../shared/data/llm_adapters``); with
    ``hub_tasks=True`` lm-eval's own task registry is searched too (e.g. ``hellaswag``; needs the hub),
    the local definitions taking precedence on equal names. A checkpoint is loaded on ``device`` (default
    ``cuda`` when available, else ``cpu``; lm-eval's own default is ``cuda`` even without a GPU).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    known = set(local_tasks()) | set(TAGS)
    unknown = [t for t in tasks if t not in known]
    if unknown and not hub_tasks:
        raise ValueError(f"unknown lm-eval task(s) {unknown}: the local tasks are {', '.join(sorted(known))}; "
                         "pass hub_tasks=True to use lm-eval's own registry (needs the Hugging Face hub)")
    folder = resolve_data_dir(data_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"data_dir {str(folder)!r} is not a directory: point it (or MOE_LAB_DATA_DIR) "
                                "to the LLM-Adapters data folder")
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=hub_tasks,
                          metadata={"data_dir": str(folder)})
    if isinstance(model_or_path, (str, os.PathLike)):
        lm = lm_eval_model(model_or_path, tokenizer, batch_size=batch_size, max_length=max_length, device=device)
        return _run(simple_evaluate, lm, tasks, manager, limit, num_fewshot, simple_evaluate_kwargs)
    with eval_mode(model_or_path):
        lm = lm_eval_model(model_or_path, tokenizer, batch_size=batch_size, max_length=max_length)
        return _run(simple_evaluate, lm, tasks, manager, limit, num_fewshot, simple_evaluate_kwargs)


def lm_eval_model(
    model_or_path: torch.nn.Module | str | os.PathLike,
    tokenizer: Any = None,
    *,
    batch_size: int = 16,
    max_length: int | None = None,
    device: str | None = None,
):
    """lm-eval's HF wrapper (``HFLM``) around an in-memory model (put it in eval mode yourself) or an export.

    An export directory is loaded by lm-eval (on ``device``, default ``cuda`` when available, else ``cpu``)
    and the moe-lab routing written beside its vanilla weights (condenser biases and condensers,
    compressed-experts vectors) is re-installed on it, as ``task=evaluate`` does: vanilla HF routing alone
    would evaluate another model.
    """
    from lm_eval.models.huggingface import HFLM

    from moe_lab.methods.registry import install_exported_routing

    if isinstance(model_or_path, (str, os.PathLike)):
        path = str(model_or_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        lm = HFLM(pretrained=path, tokenizer=tokenizer if tokenizer is not None else path,
                  batch_size=batch_size, max_length=max_length, device=device)
        install_exported_routing(lm.model, path)
        return lm
    if tokenizer is None:
        raise ValueError("an in-memory model needs its tokenizer: evaluate_with_lm_eval(model, tokenizer, ...)")
    return HFLM(pretrained=model_or_path, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)


def lm_eval_metrics(result: dict) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from a ``simple_evaluate`` result, with lm-eval's ``,none`` filter suffix
    dropped (other filters keep theirs) and the ``alias`` entry removed."""
    table = {}
    for task, metrics in result["results"].items():
        table[task] = {
            key.removesuffix(",none"): value
            for key, value in metrics.items()
            if key != "alias" and isinstance(value, (int, float))
        }
    return table


def _run(simple_evaluate, lm, tasks, manager, limit, num_fewshot, kwargs) -> dict:
    kwargs.setdefault("log_samples", False)
    return simple_evaluate(model=lm, tasks=tasks, limit=limit, num_fewshot=num_fewshot, task_manager=manager,
                           **kwargs)
