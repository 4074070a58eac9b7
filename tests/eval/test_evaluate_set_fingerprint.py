"""A re-run task=evaluate never scores old predictions against a changed set (issue 32 item 6): the predictions
record a fingerprint of the set's rows; the same set name with other rows is refused, the same rows rewritten
(another file, the same contents) continue."""

from __future__ import annotations

import json

import pytest

from moe_lab.runs.evaluate import evaluate
from tests.eval.test_evaluate_fingerprint import _export
from tests.eval.test_evaluate_task import eval_cfg, read_jsonl

SHIPPED = "moe_lab/data/files/llm_adapters/AddSub.test.json"
COMMON = ("eval=math7", "eval.limit=2", "eval.generation.max_new_tokens=4", "eval.datasets=[addsub]")


def test_a_set_rewritten_with_other_rows_is_refused(tmp_path):
    from tests.conftest import ROOT

    rows = json.loads((ROOT / SHIPPED).read_text())[:3]
    data = tmp_path / "addsub.json"
    data.write_text(json.dumps(rows))
    run, out = tmp_path / "train", tmp_path / "eval"
    export = _export(run, 0.01)
    args = (*COMMON, f"eval.paths.addsub={data}", f"task.checkpoint={export}")
    evaluate(eval_cfg(out, *args))
    before = read_jsonl(out / "predictions" / "addsub.jsonl")

    data.write_text(json.dumps(rows, indent=2))  # the same rows written again: continues
    evaluate(eval_cfg(out, *args))
    assert read_jsonl(out / "predictions" / "addsub.jsonl") == before

    rows[0] = {**rows[0], "answer": str(float(rows[0]["answer"]) + 1)}  # same name, another answer
    data.write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=r"addsub.jsonl was written for other contents of the set .*scored against "
                                         r"other answers.*\(data: '[0-9a-f]{16}' -> '[0-9a-f]{16}'\).*hydra.run.dir"):
        evaluate(eval_cfg(out, *args))
