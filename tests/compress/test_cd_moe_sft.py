"""task=cd_moe_sft end to end on a tiny DeepSeek-V2: calibrate -> condense -> SFT (retained experts only) -> lm-eval."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.compress import load_condensed
from tests.compress.test_cd_moe_sft_mmlu import ROWS
from tests.conftest import ROOT, word_text

SEARCH = ["num_sequences=4", "seq_len=16", "batch_size=2", "sample=first"]
EVAL = ["condense.eval.tasks=[llm_adapters_boolq]", "condense.eval.limit=2", "condense.eval.hub_tasks=false",
        "condense.eval.batch_size=2"]


def _compose(out, *overrides, method="condense_sft"):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"paths.output_dir={out}", "task=cd_moe_sft", f"method={method}",
                                            "model=tiny_deepseek_v2", "hardware=cpu", *overrides])


def _retained(layer: int) -> set[str]:
    """The condensed layer's own tensors: packed slices of the retained routed experts + the shared expert."""
    prefix = f"model.layers.{layer}.mlp."
    return {prefix + n for n in ("gate_up_proj", "down_proj", "shared_experts.gate_proj.weight",
                                 "shared_experts.up_proj.weight", "shared_experts.down_proj.weight")}


def _state(path) -> dict[str, torch.Tensor]:
    return load_condensed(path).state_dict()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """One paper-recipe run: MMLU-style SFT rows, 3 steps, lm-eval boolq on 2 rows."""
    from moe_lab.tasks import run_task

    tmp = tmp_path_factory.mktemp("cd_moe_sft")
    word_text(tmp / "c4.txt", 30)
    (tmp / "mmlu.json").write_text(json.dumps(ROWS * 4))
    cfg = _compose(tmp / "run", *_chain_overrides(tmp), "task.trainer.max_steps=3")
    return cfg, run_task(cfg), tmp


def _chain_overrides(tmp) -> list[str]:
    return ["dataset=mmlu_train", f"dataset.path={tmp / 'mmlu.json'}", "dataset.max_length=512", "dataset.batch_size=2",
            f"condense.search.dataset.path={tmp / 'c4.txt'}", "condense.routed_experts=2", "condense.num_layers=1",
            *[f"condense.search.{d}" for d in SEARCH], "task.optim.lr=1e-2", *EVAL]


@pytest.mark.slow
def test_chain_trains_only_retained_experts_and_evaluates_the_export(chain):
    from moe_lab.methods.condense_sft import CondenseSFTModule
    from tests.conftest import build_tiny, random_batch

    cfg, summary, _ = chain
    run = cfg.paths.output_dir
    [layer] = summary["condense"]["layers"]
    assert summary["method"] == "cd_moe_sr" and summary["sft"]["global_step"] == 3
    assert len(summary["condense"]["experts"][str(layer)]) == 2
    calibrated = json.loads((Path(run) / "calibrate" / "summary.json").read_text())["data"]["source"]
    assert calibrated == json.loads((Path(run) / "condense" / "summary.json").read_text())["search_data"]
    # only the condensed layer's retained experts (packed routed slices + shared expert) moved
    before, after = _state(summary["condense"]["export"]), _state(summary["sft"]["export"])
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == _retained(layer)
    assert after[f"model.layers.{layer}.mlp.gate_up_proj"].shape[0] == 2  # only the 2 retained routed experts are stored
    # the export is the trained module of the last checkpoint: identical logits after reload
    ckpt = torch.load(f"{run}/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 3
    module = CondenseSFTModule(build_tiny("deepseek_v2"), options={"condensed": summary["condense"]["export"]})
    module.load_state_dict(ckpt["state_dict"])
    module.eval()
    back = load_condensed(summary["checkpoint"]).eval()
    batch = random_batch(2, 8, seed=5)
    with torch.no_grad():
        assert torch.equal(back(**batch).logits, module.model(**batch).logits)
    # lm-eval stage: percent table; the LLM-Adapters task keeps its own name (not the paper's BoolQ), acc_norm
    assert summary["table"] == [{"model": "tiny_deepseek_v2", "method": "cd_moe_sr", "column": "llm_adapters_boolq",
                                 "value": 100 * summary["eval"]["llm_adapters_boolq"]["acc_norm"], "averaged": True}]
    assert summary["eval"]["llm_adapters_boolq"]["sample_len"] == 2 and summary["limit"] == 2


@pytest.mark.slow
def test_collector_prints_the_run_beside_the_paper(chain, capsys):
    """experiments.collect reads the run: labels, the SFT dataset (the run's own dataset choice) and eval.layers."""
    from experiments import collect

    cfg, summary, tmp = chain
    assert summary["eval_settings"] == {"task_source": "llm_adapters"}  # what the collector compares averages by
    run = cfg.paths.output_dir
    (tmp / "run" / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # as run.py writes them
    (tmp / "run" / ".hydra").mkdir(exist_ok=True)
    (tmp / "run" / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      dataset: mmlu_train\n")
    reported = tmp / "reported.csv"
    with open(reported, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(collect.FIELDS)
        writer.writerow(("Main", "Tiny", "tiny_deepseek_v2", "CD-MoE-SR + SFT", "cd_moe_sr", "mmlu_train", "layers=1",
                         "Avg.", "acc", "40", "test"))
        writer.writerow(("Main", "Tiny", "tiny_deepseek_v2", "CD-MoE-SR + SFT", "cd_moe_sr", "mmlu_train", "layers=9",
                         "Avg.", "acc", "60", "test"))
    assert collect.main(["condense", run, "--reported", str(reported)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "CD-MoE-SR + SFT" in line]
    # matched (layers=1), but an LLM-Adapters average beside the paper's lm-eval hub average: withheld
    assert lines[0].split("|")[6:9] == [" 40.00 ", " n/a\u2020 ", " n/a "]
    assert " n/a" in lines[1].split("|")[7]  # layers=9: another condensed model, not matched


@pytest.mark.slow
def test_code_recipe_runs_a_c4_stage_first_at_lr_1e5(chain):
    """cd_sft_recipe=code from the chain's condensed export: LM stage on text, then the task SFT from its export."""
    from moe_lab.tasks import run_task

    _, first, tmp = chain
    text = tmp / "c4.txt"
    cfg = _compose(tmp / "code", "cd_sft_recipe=code", f"cd_sft.condensed={first['condense']['export']}",
                   f"cd_sft.lm_stage.dataset.path={text}", "cd_sft.lm_stage.dataset.block_size=32",
                   "cd_sft.lm_stage.dataset.num_blocks=4", "cd_sft.lm_stage.dataset.batch_size=2",
                   "dataset=mmlu_train", f"dataset.path={tmp / 'mmlu.json'}", "dataset.max_length=512",
                   "dataset.batch_size=2", "task.trainer.max_steps=2", "condense.eval.tasks=[]")
    summary = run_task(cfg)
    assert summary["lm_stage"]["global_step"] == 2 and summary["sft"]["global_step"] == 2
    assert "calibrate" not in {p.name for p in (tmp / "code").iterdir()}
    for stage in ("lm", "."):
        with open(tmp / "code" / stage / "metrics.csv") as f:
            lrs = [float(r["lr-AdamW"]) for r in csv.DictReader(f) if r.get("lr-AdamW")]
        # the code recipe: peak 1e-5, no warm-up, linear decay over the 2 steps: 1e-5 at step 1, 5e-6 at step 2
        assert lrs and all(min(abs(lr - v) for v in (1e-5, 5e-6)) < 1e-12 for lr in lrs), lrs
    lm, final = _state(summary["lm_stage"]["export"]), _state(summary["sft"]["export"])
    start = _state(first["condense"]["export"])
    [layer] = first["condense"]["layers"]
    assert {k for k in start if not torch.equal(start[k], lm[k])} == _retained(layer)  # the LM stage trained ...
    assert {k for k in lm if not torch.equal(lm[k], final[k])} == _retained(layer)  # ... the SFT went on from it


def test_chain_refuses_other_methods_and_trims(tmp_path):
    from moe_lab.tasks import run_task

    with pytest.raises(ValueError, match="method=condense_sft"):
        run_task(_compose(tmp_path, method="sft"))
    with pytest.raises(ValueError, match="condense.method=layer_trim"):
        run_task(_compose(tmp_path, "condense.method=layer_trim"))
    with pytest.raises(FileNotFoundError, match="cd_sft.condensed="):
        run_task(_compose(tmp_path, f"cd_sft.condensed={tmp_path}"))


def test_results_table_uses_acc_norm_where_the_spec_says():
    """A4-6: acc_norm for ARC-C, HellaSwag, OBQA, PIQA; acc for BoolQ, MMLU, RTE, WinoGrande; percent; Avg. of 8."""
    from moe_lab.eval.lm_eval_table import results_table

    tasks = ["arc_challenge", "boolq", "hellaswag", "mmlu", "openbookqa", "piqa", "rte", "winogrande"]
    metrics = {t: {"acc": 0.01 * (i + 1), "acc_norm": 0.1 * (i + 1)} for i, t in enumerate(tasks)}
    metrics["mmlu"] = {"acc": 0.04}  # an lm-eval group: acc only
    table = results_table(metrics, tasks, "m", "cd_moe_sr")
    row = table.cells[("m", "cd_moe_sr")]
    assert row == pytest.approx({"ARC-C": 10.0, "BoolQ": 2.0, "HellaSwag": 30.0, "MMLU": 4.0, "OBQA": 50.0,
                                 "PIQA": 60.0, "RTE": 7.0, "WinoGrande": 8.0}, rel=1e-12)
    assert table.average(("m", "cd_moe_sr")) == (pytest.approx((10 + 2 + 30 + 4 + 50 + 60 + 7 + 8) / 8), 8)


@pytest.mark.slow
def test_exports_keep_the_search_provenance(chain):
    """The SFT export's manifest carries the condense stage's knobs and calibration, and names its source."""
    _, summary, _ = chain
    source = json.loads((Path(summary["condense"]["export"]) / "condense_manifest.json").read_text())
    final = json.loads((Path(summary["checkpoint"]) / "condense_manifest.json").read_text())
    assert final["condensed_from"] == summary["condense"]["export"]
    assert final["knobs"] == source["knobs"] and final["calibration"] == source["calibration"]
    assert final["layers"] == source["layers"] and final["knobs"]["routed_experts"] == 2


@pytest.mark.slow
def test_resume_reuses_finished_stages_and_resumes_the_sft(chain):
    """task.resume=<run> (a copy of the finished chain run): calibrate/condense are not redone, the SFT resumes from
    its last.ckpt (step 3 of 3: nothing left to train), and the export is evaluated again."""
    import shutil

    from moe_lab.tasks import run_task

    cfg, first, tmp = chain
    run = tmp / "resumed"
    shutil.copytree(cfg.paths.output_dir, run)
    stamp = {p: p.stat().st_mtime_ns for p in [run / "condense" / "summary.json", run / "calibrate" / "summary.json"]}
    summary = run_task(_compose(run, *_chain_overrides(tmp), "task.trainer.max_steps=3", f"task.resume={run}"))
    assert (summary["sft"]["resumed_from_step"], summary["sft"]["global_step"]) == (3, 3)
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp
    assert summary["condense"]["layers"] == first["condense"]["layers"] and summary["table"] == first["table"]
