"""The papers' lm-eval benchmarks in the presets (eval.lm_eval) and task=evaluate's lm-eval columns.

Oracle for the task names: docs/specs/finetuning.md section 3 written out below ([P3]: IFEval 0-shot loose, BBH 3-shot
exact match, TruthfulQA MC2, HumanEval pass@1, GSM8K 0-shot chain of thought), checked against the installed
lm-eval's own task YAMLs (read offline through its task index; nothing is downloaded).
"""

from __future__ import annotations

import csv
import functools
import json

import pytest
from hydra import compose, initialize_config_dir

from moe_lab.eval import lm_eval_bridge
from moe_lab.runs.evaluate import evaluate
from tests.conftest import DATA_DIR, ROOT

# [P3] column -> (lm-eval task, shots, result key); docs/specs/finetuning.md section 3
P3 = {
    "IFEval": ("ifeval", 0, "prompt_level_loose_acc"),
    "BBH": ("bbh_fewshot", 3, "exact_match"),
    "TruthfulQA MC2": ("truthfulqa_mc2", 0, "acc"),
    "HumanEval pass@1": ("humaneval", 0, "pass@1,create_test"),
    "HumanEval pass@10": ("humaneval_pass10", 0, "pass@10,create_test"),  # moe-lab's task (lm_eval_tasks/)
    "GSM8K": ("gsm8k_cot_zeroshot", 0, "exact_match,flexible-extract"),
}
# [P1] (docs/specs/finetuning.md section 3 names the benchmarks, no shot counts): column -> lm-eval task per row
P1 = {
    "densemixer/gsm_olmoe": {"GSM": "gsm8k"},
    "densemixer/gsm_qwen1_5": {"GSM": "gsm8k"},
    **{f"densemixer/{row}": {"HumanEval": "humaneval", "HumanEval+": "humaneval_plus", "MBPP": "mbpp"}
       for row in ("codealpaca_olmoe", "codealpaca_qwen1_5", "nemotron_code_qwen3_base",
                   "nemotron_code_qwen3_base_pub")},
}
P3_PRESETS = ["compressed_experts/olmoe", "compressed_experts/olmoe_topk_half", "compressed_experts/phimoe",
              "compressed_experts/phimoe_topk_half"]


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@functools.cache
def _index():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(lm_eval_bridge.TASK_DIR)).task_index  # + moe-lab's humaneval_pass10


def _yaml(name: str) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(_index()[name].yaml_path, resolve_func=False)


def _subtasks(name: str) -> list[dict]:
    """The task's YAML, or each member task's YAML for a group."""
    cfg = _yaml(name)
    return [_yaml(t) for t in cfg["task"]] if "group" in cfg and isinstance(cfg.get("task"), list) else [cfg]


def _result_keys(name: str) -> set[str]:
    """``metric[,filter]`` keys the task reports (function metrics named as lm-eval expands them)."""
    cfg = _yaml(name)
    if "aggregate_metric_list" in cfg:
        return {m["metric"] for m in cfg["aggregate_metric_list"]}
    filters = [f["name"] for f in cfg.get("filter_list", [])] or ["none"]
    metrics = set()
    for m in cfg["metric_list"]:
        metric = str(m["metric"])
        if metric.endswith(".pass_at_k"):  # pass_at_k(k=[...]) reports pass@<k>
            metrics |= {f"pass@{k}" for k in m["k"]}
        else:
            metrics.add(metric.rsplit(".", 1)[-1])
    return {m if f == "none" else f"{m},{f}" for m in metrics for f in filters}


@pytest.mark.parametrize("preset", P3_PRESETS)
def test_p3_presets_name_the_papers_lm_eval_tasks(preset):
    ev = _compose(f"experiment={preset}").eval
    assert list(ev.datasets) == [] and ev.lm_eval.num_fewshot is None  # each task at its own shot count
    assert {c: (s.task, s.metric) for c, s in ev.lm_eval.tasks.items()} == {c: (t, m) for c, (t, _, m) in P3.items()}


@pytest.mark.parametrize("column", sorted(P3))
def test_p3_tasks_exist_with_the_spec_shot_counts(column):
    task, shots, metric = P3[column]
    members = _subtasks(task)
    assert {m.get("num_fewshot", 0) for m in members} == {shots}
    assert metric in _result_keys(task)
    if task == "bbh_fewshot":  # 3-shot exact match over the 27 BBH tasks, answer only (no CoT exemplars)
        assert len(members) == 27 and all(m["metric_list"][0]["metric"] == "exact_match" for m in members)
        assert all(len(m["fewshot_config"]["samples"]) == 3 for m in members if "samples" in m["fewshot_config"])
    if task == "gsm8k_cot_zeroshot":
        assert members[0]["doc_to_text"].endswith("Let's think step by step.")


@pytest.mark.parametrize("preset", sorted(P1))
def test_p1_presets_name_existing_lm_eval_tasks(preset):
    ev = _compose(f"experiment={preset}").eval
    assert {c: s.task for c, s in ev.lm_eval.tasks.items()} == P1[preset]
    for spec in ev.lm_eval.tasks.values():
        assert spec.metric in _result_keys(spec.task)


@pytest.mark.parametrize("preset", P3_PRESETS + sorted(P1))
def test_code_executing_tasks_are_confirmed(preset):
    ev = _compose(f"experiment={preset}").eval
    unsafe = any(_yaml(s.task).get("unsafe_code") for s in ev.lm_eval.tasks.values())
    assert unsafe == bool(ev.lm_eval.confirm_run_unsafe_code)


# ------------------------------------------------------------------------------------------------------------
# task=evaluate with eval.lm_eval


def _eval_cfg(out, *overrides):
    return _compose("task=evaluate", f"paths.output_dir={out}", f"paths.data_dir={DATA_DIR}", "logger=none",
                    "eval=math7", "eval.datasets=[]", *overrides)


def test_evaluate_writes_one_column_per_lm_eval_task(tmp_path, monkeypatch):
    calls = []

    def fake(model, tokenizer, tasks, **kwargs):
        calls.append((list(tasks), kwargs))
        return {"results": {"ifeval": {"alias": "ifeval", "prompt_level_loose_acc,none": 0.25},
                            "humaneval": {"pass@1,create_test": 0.5}}}

    monkeypatch.setattr(lm_eval_bridge, "evaluate_with_lm_eval", fake)
    out = tmp_path / "run"
    metrics = evaluate(_eval_cfg(out, "eval.limit=4", "eval.lm_eval.confirm_run_unsafe_code=true",
                                 "+eval.lm_eval.tasks.IFEval={task: ifeval, metric: prompt_level_loose_acc}",
                                 "+eval.lm_eval.tasks.HumanEval={task: humaneval, metric: 'pass@1,create_test'}"))
    [(tasks, kwargs)] = calls
    assert tasks == ["ifeval", "humaneval"]
    assert (kwargs["limit"], kwargs["num_fewshot"], kwargs["hub_tasks"], kwargs["confirm_run_unsafe_code"]) == (
        4, None, True, True)
    assert metrics == {"eval/ifeval/prompt_level_loose_acc": 0.25, "eval/humaneval/pass@1/create_test": 0.5,
                       "eval/avg": 0.375}
    with open(out / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert (float(row["IFEval"]), float(row["HumanEval"])) == (25.0, 50.0)
    assert json.loads((out / "summary.json").read_text())["datasets"]["humaneval"]["column"] == "HumanEval"


def test_evaluate_lm_eval_errors_name_the_field(tmp_path, monkeypatch):
    monkeypatch.setattr(lm_eval_bridge, "evaluate_with_lm_eval", lambda *a, **k: {"results": {"ifeval": {}}})
    with pytest.raises(ValueError, match=r"eval.lm_eval.tasks.IFEval must be \{task: <lm-eval task>, metric"):
        evaluate(_eval_cfg(tmp_path / "a", "+eval.lm_eval.tasks.IFEval=ifeval"))
    with pytest.raises(KeyError, match=r"eval.lm_eval.tasks.IFEval: lm-eval reported no 'acc' for ifeval"):
        evaluate(_eval_cfg(tmp_path / "b", "+eval.lm_eval.tasks.IFEval={task: ifeval, metric: acc}"))
    with pytest.raises(ValueError, match=r"or lm-eval tasks: eval.lm_eval.tasks"):
        evaluate(_eval_cfg(tmp_path / "c"))


def test_evaluate_runs_a_real_lm_eval_task(tmp_path):
    """Through the real lm-eval (a local LLM-Adapters task, offline) on the tiny model: the column holds the
    task's accuracy over the 2 rows (0, 50 or 100) and equals 100 x the summary's value."""
    out = tmp_path / "run"
    evaluate(_eval_cfg(out, "eval.limit=2", "eval.batch_size=2", "eval.lm_eval.hub_tasks=false",
                       "+eval.lm_eval.tasks.BoolQ={task: llm_adapters_boolq, metric: acc}"))
    summary = json.loads((out / "summary.json").read_text())
    value = summary["datasets"]["llm_adapters_boolq"]["value"]
    with open(out / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert value in (0.0, 0.5, 1.0) and float(row["BoolQ"]) == 100.0 * value
