"""task=evaluate on a dense export (``<run>/distill/export`` of task=moe_to_dense): the run's method (kd, from the
config.yaml beside the export) lets the dense model load. Oracle: vanilla ``AutoModelForCausalLM.from_pretrained``
of the export (its logits, and per-choice log-likelihoods summed from its log-softmax)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from moe_lab.compress.calibration import calibrate
from moe_lab.compress.dense import export_compressed, to_dense
from moe_lab.eval.choices import choice_item
from moe_lab.models import load_model
from moe_lab.runs.evaluate import evaluate, load_for_eval
from tests.conftest import DATA_DIR, random_batch, tiny_model_cfg
from tests.eval.test_evaluate_task import eval_cfg, read_jsonl


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A to_dense K=4 student of tiny_qwen3_moe exported as task=moe_to_dense lays it out, with the stage's
    config.yaml (model tiny_qwen3_moe_dense, method kd and the class it names) beside it."""
    run = tmp_path_factory.mktemp("m2d") / "distill"
    teacher, tokenizer = load_model(tiny_model_cfg("qwen3_moe"))
    student = to_dense(teacher.eval(), calibrate(teacher, [random_batch(batch=2, seq=16, pad_rows=())]), K=4)
    export_compressed(student, run / "export", tokenizer)
    OmegaConf.save(OmegaConf.create({"model": {"name": "tiny_qwen3_moe_dense"}, "method": {"name": "kd", "_target_": "moe_lab.methods.distill.KDModule"}}),
                   run / "config.yaml")
    return run / "export"


def test_dense_export_loads_with_the_runs_method_and_equals_vanilla_hf(export, tmp_path):
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert vanilla.config.model_type == "qwen3"
    model, tokenizer, labels = load_for_eval(eval_cfg(tmp_path / "a", "eval=commonsense8",
                                                      f"task.checkpoint={export}"))
    assert labels == ("tiny_qwen3_moe_dense", "kd")
    ids = torch.tensor([tokenizer("A dense student, evaluated.").input_ids])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, vanilla(ids).logits)

    out = tmp_path / "run"
    evaluate(eval_cfg(out, "eval=commonsense8", "eval.datasets=[winogrande]", "eval.limit=2", "eval.batch_size=1",
                      "eval.generation.max_new_tokens=2", f"task.checkpoint={export}"))
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["model"], summary["method"]) == ("tiny_qwen3_moe_dense", "kd")
    rows = json.loads((DATA_DIR / "winogrande.test.json").read_text())[:2]
    records = read_jsonl(out / "predictions" / "winogrande.mc.jsonl")
    assert len(records) == 2
    for row, rec in zip(rows, records):
        item = choice_item("option", row["instruction"], row["answer"])
        for choice, ll in zip(item.choices, rec["loglik"]):
            ctx, full = tokenizer(item.context).input_ids, tokenizer(item.context + choice).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(vanilla(torch.tensor([full[:-1]])).logits[0].float(), -1)
            expected = sum(logp[t - 1, full[t]].item() for t in range(len(ctx), len(full)))
            # same unpadded sequence either way; the task sums n fp32 log-probs (the oracle in float64): running
            # sums up to |ll| ~ 200 round by <= eps32 * |ll| per addition; x 2 for the per-token logit rounding
            n = len(full) - len(ctx)
            assert ll == pytest.approx(expected, rel=0, abs=2 * n * 1.2e-7 * abs(expected)), (choice, ll, expected)


def test_dense_export_without_run_config_or_with_an_moe_method_is_refused(export, tmp_path):
    lone = tmp_path / "copied" / "export"
    lone.mkdir(parents=True)
    for f in export.iterdir():
        (lone / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match=r"unsupported model_type 'qwen3'.*method=kd\)\. task.checkpoint=\S+: the "
                                         r"method comes from the config.yaml of the run that wrote the export, and "
                                         r"\S+copied/config.yaml does not exist"):
        load_for_eval(eval_cfg(tmp_path / "a", f"task.checkpoint={lone}"))
    OmegaConf.save(OmegaConf.create({"model": {"name": "x"}, "method": {"name": "sft"}}), lone.parent / "config.yaml")
    with pytest.raises(ValueError, match=r"method=sft trains MoE models, but model.pretrained=\S+ is a dense 'qwen3'"):
        load_for_eval(eval_cfg(tmp_path / "b", f"task.checkpoint={lone}"))
