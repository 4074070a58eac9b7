"""HumanEval pass@10 ([P3]): moe-lab's ``humaneval_pass10`` lm-eval task and its pass@k estimator, offline.

Oracles: the closed form ``1 - C(n-c, k) / C(n, k)`` of Chen et al. 2021 computed with ``math.comb`` on
hand-made per-sample correctness; lm-eval's own ``humaneval.yaml`` (read from the installed package) for the
fields the task repeats; a text scan of lm-eval's YAMLs for name clashes. No model code is executed: the sandbox
call (``check_correctness``) is replaced by a lookup of the hand-made verdicts.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from moe_lab.eval import lm_eval_bridge
from tests.conftest import ROOT

TASK = "humaneval_pass10"
TASK_DIR = lm_eval_bridge.TASK_DIR / TASK
P3_PRESETS = ["compressed_experts/olmoe", "compressed_experts/olmoe_topk_half", "compressed_experts/phimoe",
              "compressed_experts/phimoe_topk_half"]


def closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # comb(m, k) = 0 for m < k


def _utils():
    from lm_eval.tasks._yaml_loader import _load_module_with_cache

    return _load_module_with_cache(TASK_DIR / "utils.py")


# ------------------------------------------------------------------------------------------------------------
# the estimator


@pytest.mark.parametrize("n,c", [(10, 0), (10, 1), (10, 3), (10, 10), (20, 0), (20, 1), (20, 7), (20, 11), (20, 20),
                                 (13, 2), (200, 5)])
@pytest.mark.parametrize("k", [1, 10])
def test_estimator_equals_the_closed_form(n, c, k):
    correct = [True] * c + [False] * (n - c)
    if c % 2:
        correct.reverse()  # any order: the estimator depends on the count only
    value = _utils().estimate_pass_at_k([correct], k)
    # product of <= n factors in (0, 1]: relative rounding <= n * 2**-52
    assert value == pytest.approx(closed_form(n, c, k), rel=0, abs=n * 2.0 ** -52 + 1e-300)
    if k == 1:
        assert value == pytest.approx(c / n, abs=n * 2.0 ** -52)


def test_estimator_averages_over_problems_and_needs_k_samples():
    correct = [[True, False] * 10, [False] * 20, [True] + [False] * 19, [True] * 20]
    expected = sum(closed_form(20, sum(c), 10) for c in correct) / 4
    assert _utils().estimate_pass_at_k(correct, 10) == pytest.approx(expected, abs=1e-14)
    with pytest.raises(ValueError, match=r"pass@10 needs at least 10 samples per problem, got 9.*repeats"):
        _utils().estimate_pass_at_k([[True] * 9], 10)


# ------------------------------------------------------------------------------------------------------------
# the task through lm-eval's TaskManager (moe-lab's folder + lm-eval's registry, as task=evaluate uses it)


def _lm_eval_yaml(name: str) -> Path:
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks" / "humaneval" / name


DOCS = [
    {"task_id": "T/0", "prompt": "def f(x):\n", "test": "def check(g):\n    assert g(1) == 2\n", "entry_point": "f",
     "canonical_solution": ""},
    {"task_id": "T/1", "prompt": "def h():\n", "test": "def check(g):\n    assert g() == 0\n", "entry_point": "h",
     "canonical_solution": ""},
]
PASSES = [7, 1]  # correct samples per problem (of 20)


@pytest.fixture(scope="module")
def built():
    """(index entry, task object): lm-eval builds the task; its dataset is the two hand-made docs above."""
    import datasets
    from lm_eval.api.task import ConfigurableTask

    def fake_download(self, *args, **kwargs):
        self.dataset = datasets.DatasetDict({"test": datasets.Dataset.from_list(DOCS)})

    manager = lm_eval_bridge.task_manager([TASK, "humaneval"], hub_tasks=True)
    original = ConfigurableTask.download
    ConfigurableTask.download = fake_download
    try:
        task = manager.load([TASK])["tasks"][TASK]
    finally:
        ConfigurableTask.download = original
    return manager.task_index[TASK], task


def _metric(task):
    """The metric function lm-eval resolved from the YAML (it keeps the function's bound ``__call__``)."""
    return task._metric_fn_list["pass_at_k"].__self__


def test_task_resolves_with_repeats_and_pass10(built):
    entry, task = built
    assert Path(entry.yaml_path).parent == TASK_DIR
    cfg = task.config
    assert cfg.task == TASK and cfg.repeats >= 10 and cfg.num_fewshot == 0 and cfg.unsafe_code
    gen = cfg.generation_kwargs
    assert gen["do_sample"] is True and (gen["temperature"], gen["top_p"]) == (0.8, 0.95)
    [metric] = cfg.metric_list
    assert 10 in metric["k"] and metric["aggregation"] == "mean"
    assert _metric(task).__module__.endswith("humaneval_pass10/utils")
    assert task.aggregation()["pass_at_k"].__name__ == "mean"


def test_task_repeats_lm_evals_humaneval(built):
    from lm_eval.tasks._yaml_loader import load_yaml

    _, task = built
    ours = load_yaml(TASK_DIR / f"{TASK}.yaml", resolve_func=False)
    theirs = load_yaml(_lm_eval_yaml("humaneval.yaml"), resolve_func=False)
    for field in ("dataset_path", "unsafe_code", "output_type", "test_split", "doc_to_text", "doc_to_target",
                  "num_fewshot"):
        assert ours[field] == theirs[field], field
    for field in ("until", "max_gen_toks"):
        assert ours["generation_kwargs"][field] == theirs["generation_kwargs"][field], field
    assert [f["name"] for f in ours["filter_list"]] == [f["name"] for f in theirs["filter_list"]] == ["create_test"]
    # lm-eval's sampling variant scores with the same pass_at_k(k=[...]) metric signature
    sampled = load_yaml(_lm_eval_yaml("humaneval_64.yaml"), resolve_func=False)
    assert [m.get("k") is not None for m in sampled["metric_list"]] == [True]
    assert task.doc_to_text(DOCS[0]) == DOCS[0]["prompt"]
    assert task.doc_to_target(DOCS[0]) == DOCS[0]["test"] + "\ncheck(f)"


def test_name_shadows_no_lm_eval_task(built):
    import lm_eval

    entry, _ = built
    clash = [p for p in (Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml")
             if re.search(rf"^(task|group|tag):\s*\[?\s*{TASK}\b", p.read_text(encoding="utf-8"), re.MULTILINE)]
    assert clash == [] and "site-packages" not in str(entry.yaml_path)
    assert TASK not in lm_eval_bridge.local_tasks()  # not an LLM-Adapters task: no data_dir needed
    with pytest.raises(ValueError, match=r"unknown lm-eval task.*humaneval_pass10.*hub_tasks=True"):
        lm_eval_bridge.task_manager([TASK], hub_tasks=False)


def test_process_results_scores_each_problem_and_aggregates(built, monkeypatch):
    """The task's own filter + metric on 20 samples per problem; verdicts hand-made (no code runs)."""
    _, task = built
    n = task.config.repeats
    metric = _metric(task)
    verdicts, ran = {}, []
    per_doc = []
    for doc, c in zip(DOCS, PASSES):
        completions = [f"    return {i}  # sample {i}\n" for i in range(n)]
        passing = set(range(1, 2 * c, 2))  # c samples, not the first ones
        for i, completion in enumerate(completions):
            verdicts[doc["prompt"] + completion + "\n" + task.doc_to_target(doc)] = i in passing
        [programs] = metric.__globals__["build_predictions"]([completions], [doc])
        assert programs == [doc["prompt"] + r for r in completions]
        per_doc.append((doc, programs))

    def fake_check(program, timeout):
        assert timeout == 3.0
        ran.append(program)
        return verdicts[program]

    monkeypatch.setitem(metric.__globals__, "check_correctness", fake_check)
    scores = [task.process_results(doc, [programs]) for doc, programs in per_doc]
    assert sorted(ran) == sorted(verdicts)  # every sample once, completion + "\n" + test
    for score, c in zip(scores, PASSES):
        assert set(score) == {"pass@1", "pass@10"}
        assert score["pass@10"] == pytest.approx(closed_form(n, c, 10), abs=n * 2.0 ** -52)
        assert score["pass@1"] == pytest.approx(c / n, abs=n * 2.0 ** -52)
    mean = task.aggregation()["pass@10"]([s["pass@10"] for s in scores])
    assert mean == pytest.approx(sum(closed_form(n, c, 10) for c in PASSES) / len(PASSES), abs=1e-14)


# ------------------------------------------------------------------------------------------------------------
# the [P3] presets


@pytest.mark.parametrize("preset", P3_PRESETS)
def test_p3_presets_report_pass10(preset):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        ev = compose(config_name="config", overrides=[f"experiment={preset}"]).eval
    spec = ev.lm_eval.tasks["HumanEval pass@10"]
    assert (spec.task, spec.metric) == (TASK, "pass@10,create_test")
    assert ev.lm_eval.hub_tasks and ev.lm_eval.confirm_run_unsafe_code


# ------------------------------------------------------------------------------------------------------------
# end to end through lm-eval (tiny model, the two hand-made docs; verdicts from a rule on the program text)


def test_lm_eval_run_reports_the_presets_result_key(built, monkeypatch):
    """``simple_evaluate`` samples ``repeats`` completions per doc and reports "pass@10,create_test" (the key the
    [P3] presets read) = the closed form over the logged programs' verdicts."""
    _, task = built
    import datasets
    from lm_eval.api.task import ConfigurableTask

    from moe_lab.data.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer
    from moe_lab.eval.lm_eval_bridge import evaluate_with_lm_eval
    from tests.conftest import build_tiny

    def fake_download(self, *args, **kwargs):
        self.dataset = datasets.DatasetDict({"test": datasets.Dataset.from_list(DOCS)})

    def verdict(program, timeout=3.0):  # stands in for running the program (nothing is executed)
        return len(program) % 3 == 0

    monkeypatch.setattr(ConfigurableTask, "download", fake_download)
    monkeypatch.setattr(_utils(), "check_correctness", verdict)
    model = build_tiny("olmoe", vocab_size=BYTE_VOCAB_SIZE, max_position_embeddings=256).eval()
    result = evaluate_with_lm_eval(model, build_byte_tokenizer(), [TASK], hub_tasks=True, batch_size=8,
                                   confirm_run_unsafe_code=True, gen_kwargs={"max_gen_toks": 6}, log_samples=True)
    samples = result["samples"][TASK]
    assert len(samples) == len(DOCS)
    expected = []
    for sample in samples:
        [programs], [responses] = sample["filtered_resps"], sample["resps"]
        assert len(responses) == 20 and len(set(responses)) > 1  # 20 sampled completions, not one greedy
        assert programs == [sample["doc"]["prompt"] + r for r in responses]
        test = task.doc_to_target(sample["doc"])  # each program runs with its test appended
        expected.append(closed_form(20, sum(verdict(p + "\n" + test) for p in programs), 10))
    reported = result["results"][TASK]
    assert reported["pass@10,create_test"] == pytest.approx(sum(expected) / len(expected), abs=1e-14)
    assert "pass@1,create_test" in reported
