"""A resumed task=evaluate never mixes two models (issue 21 item 13): the predictions record a fingerprint of the
weights; an export rewritten with other weights between the interrupted and the resumed run is refused, the same
weights written again (new files, new mtimes) resume."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.eval.fingerprint import weights_fingerprint
from moe_lab.models import load_model
from moe_lab.runs.evaluate import evaluate
from tests.conftest import tiny_model_cfg
from tests.eval.test_evaluate_task import eval_cfg, read_jsonl

COMMON = ("eval=math7", "eval.limit=2", "eval.generation.max_new_tokens=4")


def _export(run, shift: float):
    model, tokenizer = load_model(tiny_model_cfg("qwen3_moe"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift)
    model.save_pretrained(run / "export")
    tokenizer.save_pretrained(run / "export")
    OmegaConf.save(OmegaConf.create({"model": {"name": "tiny_qwen3_moe"}, "method": {"name": "sft"}}),
                   run / "config.yaml")
    return run / "export"


def test_resumed_evaluation_refuses_an_export_with_other_weights(tmp_path):
    run, out = tmp_path / "train", tmp_path / "eval"
    export = _export(run, 0.01)
    first = weights_fingerprint(export)
    evaluate(eval_cfg(out, *COMMON, "eval.datasets=[addsub]", f"task.checkpoint={export}"))  # interrupted here
    before = read_jsonl(out / "predictions" / "addsub.jsonl")

    _export(run, 0.01)  # the same weights written again: other files, other mtimes, the same fingerprint
    assert weights_fingerprint(export) == first
    evaluate(eval_cfg(out, *COMMON, "eval.datasets=[addsub,svamp]", f"task.checkpoint={export}"))
    assert read_jsonl(out / "predictions" / "addsub.jsonl") == before

    _export(run, 0.02)  # export/ rewritten by another training
    assert weights_fingerprint(export) != first
    with pytest.raises(ValueError, match=r"addsub.jsonl was written with another model \(its weights changed since"
                                         r".*\(weights: '[0-9a-f]{16}' -> '[0-9a-f]{16}'\).*hydra.run.dir"):
        evaluate(eval_cfg(out, *COMMON, "eval.datasets=[addsub,svamp]", f"task.checkpoint={export}"))
