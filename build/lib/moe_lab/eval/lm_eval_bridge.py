"""lm-evaluation-harness on a moe-lab model (in memory or an exported checkpoint), offline.

The task definitions in ``lm_eval_tasks/`` read the LLM-Adapters test files; their names carry the prefix
``llm_adapters_`` so that they never shadow lm-eval's own tasks of the same benchmark (``boolq``,
``arc_challenge``, ... are lm-eval's definitions, hub data and prompts): multiple choice
``llm_adapters_{boolq,piqa,social_iqa,winogrande,arc_easy,arc_challenge,openbookqa}`` (tag
``llm_adapters_commonsense``) and generation ``llm_adapters_{gsm8k,svamp,multiarith,addsub,aqua,singleeq,mawps}``
(tag ``llm_adapters_math``). The same folder works on the lm-eval command line::

    lm_eval --model hf --model_args pretrained=out/export --include_path moe_lab/eval/lm_eval_tasks \\
        --tasks llm_adapters_boolq,llm_adapters_social_iqa --metadata '{"data_dir": "moe_lab/data/files/llm_adapters"}'

but only :func:`evaluate_with_lm_eval` (:func:`lm_eval_model`) re-installs the moe-lab routing an export
carries beside its vanilla weights (Expert Condenser, Compressed Experts); the command line evaluates
such an export with vanilla HF routing.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from moe_lab.eval.eval_sets import data_dir as resolve_data_dir
from moe_lab.eval.likelihood import eval_mode

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
PREFIX = "llm_adapters_"
TAGS = ("llm_adapters_commonsense", "llm_adapters_math")


def local_tasks() -> list[str]:
    """Names of the task definitions shipped in ``lm_eval_tasks/`` (all ``llm_adapters_<set>``)."""
    return sorted(p.stem for p in TASK_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def check_task_names(tasks: list[str], hub_tasks: bool) -> list[str]:
    """The local (LLM-Adapters) names among ``tasks``; a pre-rename local name (``boolq``) without
    ``hub_tasks`` and any other unknown name without ``hub_tasks`` are errors that say what to pass."""
    known = set(local_tasks()) | set(TAGS)
    for task in tasks:
        if task not in known and PREFIX + task in known and not hub_tasks:
            raise ValueError(
                f"lm-eval task {task!r} is lm-eval's own definition (hub data and prompt), which needs "
                f"hub_tasks=True (condense.eval.hub_tasks=true); moe-lab's LLM-Adapters version over the local test "
                f"file is named {PREFIX + task!r}")
    unknown = [t for t in tasks if t not in known]
    if unknown and not hub_tasks:
        raise ValueError(f"unknown lm-eval task(s) {unknown}: the local tasks are {', '.join(sorted(known))}; "
                         "pass hub_tasks=True to use lm-eval's own registry (needs the Hugging Face hub)")
    return [t for t in tasks if t in known]


def task_manager(tasks: list[str], *, hub_tasks: bool = False, data_dir: str | os.PathLike | None = None):
    """lm-eval's ``TaskManager`` for ``tasks``: the local LLM-Adapters definitions (``data_dir`` checked only
    when one of them is asked for) plus, with ``hub_tasks``, lm-eval's own registry. The names never overlap,
    so every hub name keeps lm-eval's definition; a name neither has is an error."""
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    local = check_task_names(tasks, hub_tasks)
    metadata = None
    if local:
        folder = resolve_data_dir(data_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"data_dir {str(folder)!r} is not a directory: point it (or MOE_LAB_DATA_DIR) "
                                    "to the LLM-Adapters data folder")
        metadata = str(folder)
    manager = _manager(bool(hub_tasks), metadata)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        renamed = [PREFIX + t for t in unknown if PREFIX + t in local_tasks()]
        raise ValueError(f"unknown lm-eval task(s) {unknown}: neither lm-eval's registry nor moe-lab's local tasks "
                         f"({', '.join(local_tasks())}) define them; `lm_eval ls tasks` lists lm-eval's names"
                         + (f"; the LLM-Adapters version is {', '.join(renamed)}" if renamed else ""))
    return manager


@functools.lru_cache(maxsize=4)
def _manager(hub_tasks: bool, data_dir: str | None):
    """One index per (registry, data folder): indexing lm-eval's registry reads thousands of YAML files."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR), include_defaults=hub_tasks,
                       metadata=None if data_dir is None else {"data_dir": data_dir})


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
    ``tokenizer`` defaults to the checkpoint's. ``llm_adapters_*`` tasks come from ``lm_eval_tasks/`` over
    the LLM-Adapters files in ``data_dir`` (default ``$MOE_LAB_DATA_DIR``, else the packaged copy);
    with ``hub_tasks=True`` lm-eval's own registry is searched too (``boolq``, ``hellaswag``, ...: lm-eval's
    definitions, never the local ones; needs the hub or its cache). A checkpoint is loaded on ``device``
    (default ``cuda`` when available, else ``cpu``; lm-eval's own default is ``cuda`` even without a GPU).
    """
    from lm_eval import simple_evaluate

    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    manager = task_manager(tasks, hub_tasks=hub_tasks, data_dir=data_dir)
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
