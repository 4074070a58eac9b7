"""lm-eval metrics as the CD-MoE papers' results table (task=condense, task=cd_moe_sft), and where the tasks
come from."""

from __future__ import annotations

# lm-eval task -> (results column, metric): acc_norm where lm-eval has it, acc otherwise (spec A4-6)
COLUMNS = {"arc_challenge": ("ARC-C", "acc_norm"), "boolq": ("BoolQ", "acc"), "hellaswag": ("HellaSwag", "acc_norm"),
           "mmlu": ("MMLU", "acc"), "openbookqa": ("OBQA", "acc_norm"), "piqa": ("PIQA", "acc_norm"),
           "rte": ("RTE", "acc"), "winogrande": ("WinoGrande", "acc")}


def results_table(metrics: dict, tasks: list[str], model: str, method: str):
    """:class:`ResultsTable` (percent) of lm-eval metrics ``{task: {metric: value}}``; one column per task."""
    from .results import ResultsTable

    table = ResultsTable()
    for task in tasks:
        title, metric = COLUMNS.get(task, (task, "acc_norm" if "acc_norm" in metrics.get(task, {}) else "acc"))
        value = metrics.get(task, {}).get(metric)
        table.add(model, method, title, None if value is None else 100 * value)
    return table


def task_source(tasks: list[str]) -> str:
    """Where lm-eval ``tasks`` come from, for the summary (experiments.collect compares averages of one source
    only): ``hub`` (lm-eval's own tasks), ``llm_adapters`` (moe-lab's ``llm_adapters_*`` over the local files)
    or ``mixed``."""
    from .lm_eval_bridge import check_task_names

    tasks = set(tasks)
    local = set(check_task_names(sorted(tasks), hub_tasks=True))
    return "hub" if not local else "llm_adapters" if local == tasks else "mixed"
