"""experiments.collect: a paper's hub-task average is never compared with an average over other tasks, and the
DenseMixer GSM / CodeAlpaca / Nemotron-code table layout.

Oracles: run directories written by hand (summary.json, config.yaml, the training run's hydra.yaml) with values
whose mean is known (40 and 60 -> 50); the task sources by construction (lm-eval names vs ``llm_adapters_*``);
the DenseMixer presets' own ``eval.lm_eval`` columns and ``dataset`` choices, composed with Hydra.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments import collect
from moe_lab.tasks.cd_moe_sft import task_source
from tests.conftest import ROOT

MODEL = "tiny_deepseek_v2"


def test_task_source_names_hub_local_and_mixed():
    assert task_source(["arc_challenge", "boolq", "hellaswag"]) == "hub"
    assert task_source(["humaneval", "humaneval_pass10"]) == "hub"  # moe-lab's pass@10 task reads hub data
    assert task_source(["llm_adapters_boolq", "llm_adapters_piqa"]) == "llm_adapters"
    assert task_source(["llm_adapters_commonsense"]) == "llm_adapters"
    assert task_source(["boolq", "llm_adapters_piqa"]) == "mixed"


def _run(path, method, settings=None, eval_cfg=None, columns=("ARC-C", "BoolQ"), values=(40.0, 60.0)):
    """A run directory as task=condense (``settings`` -> summary eval_settings) or task=evaluate
    (``eval_cfg`` -> config.yaml ``eval``) write it."""
    path.mkdir(parents=True)
    table = [{"model": MODEL, "method": method, "column": c, "value": v, "averaged": True}
             for c, v in zip(columns, values)]
    summary = {"table": table, "columns": list(columns), "limit": None}
    if settings is not None:
        summary["eval_settings"] = settings
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "config.yaml").write_text(OmegaConf.to_yaml({"eval": eval_cfg} if eval_cfg is not None else {}))
    return str(path)


def _reported(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(collect.FIELDS)
        for row, cond in rows:
            writer.writerow(("Main", "Tiny", MODEL, row.upper(), row, "", cond, "Avg.", "acc", "45", "test"))
    return str(path)


def _avg_cells(out: str) -> dict[str, list[str]]:
    """paper row label -> [paper, ours, diff] of its Avg. line."""
    cells = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) > 8 and parts[4] == "Avg.":
            cells[parts[2]] = parts[6:9]
    return cells


@pytest.fixture()
def runs(tmp_path):
    hub = {"name": "lm_eval", "layers": 8, "task_source": "hub"}
    return tmp_path, [
        _run(tmp_path / "hub", "cd_moe_s", hub),
        _run(tmp_path / "local", "cd_moe_sr", {**hub, "task_source": "llm_adapters"}),
        _run(tmp_path / "old", "layer_trim", {"name": "lm_eval", "layers": 8}),  # written before task_source
        _run(tmp_path / "evaluate_sets", "block_trim", eval_cfg={"name": "math7", "datasets": ["boolq", "piqa"]}),
        _run(tmp_path / "evaluate_hub", "original", eval_cfg={"name": "lm_eval", "datasets": [], "lm_eval": {
            "tasks": {"ARC-C": {"task": "arc_challenge", "metric": "acc_norm"},
                      "BoolQ": {"task": "boolq", "metric": "acc"}}}}),
    ]


ROWS = [("cd_moe_s", "layers=8"), ("cd_moe_sr", "layers=8"), ("layer_trim", "layers=8"), ("block_trim", ""),
        ("original", "")]


def test_hub_paper_average_is_withheld_beside_other_sources(runs, capsys):
    tmp, dirs = runs
    reported = _reported(tmp / "reported.csv", ROWS)
    assert "condense" in collect.HUB_AVERAGES
    assert collect.main(["condense", *dirs, "--reported", reported, "--out", str(tmp / "cmp")]) == 0
    out = capsys.readouterr().out
    cells = _avg_cells(out)
    assert cells["CD_MOE_S"] == ["45.00", "50.00", "+5.00"]  # hub tasks: (40 + 60) / 2 vs 45
    assert cells["ORIGINAL"] == ["45.00", "50.00", "+5.00"]  # task=evaluate over lm-eval hub names
    for row in ("CD_MOE_SR", "LAYER_TRIM", "BLOCK_TRIM"):  # llm_adapters, unrecorded, moe-lab eval sets
        assert cells[row] == ["45.00", "n/a\u2020", "n/a"], row
    assert "\u2020 not compared: the paper's Avg. is a mean of lm-eval hub tasks" in out
    assert "| Avg. |" not in out.split("### ours without a paper cell")[1]  # withheld, not unmatched
    with open(tmp / "cmp" / "comparison.csv") as f:
        notes = {r["method"]: r["note"] for r in csv.DictReader(f)}
    assert notes["CD_MOE_S"] == notes["ORIGINAL"] == ""
    assert notes["CD_MOE_SR"] == "ours averages llm_adapters tasks, the paper lm-eval hub tasks"
    assert notes["LAYER_TRIM"] == "ours averages unrecorded tasks, the paper lm-eval hub tasks"
    assert notes["BLOCK_TRIM"] == "ours averages moe_lab tasks, the paper lm-eval hub tasks"


def test_other_papers_compare_every_average(runs, capsys):
    """The guard is the paper's (HUB_AVERAGES): the same cells under a paper without hub averages are compared."""
    tmp, dirs = runs
    reported = _reported(tmp / "reported.csv", ROWS)
    assert "condenser" not in collect.HUB_AVERAGES
    assert collect.main(["condenser", *dirs, "--reported", reported]) == 0
    out = capsys.readouterr().out
    cells = _avg_cells(out)
    assert len(cells) == 5 and all(v == ["45.00", "50.00", "+5.00"] for v in cells.values()), cells
    assert "\u2020" not in out


def test_mixed_evaluate_run_is_mixed(tmp_path):
    run = _run(tmp_path / "mixed", "sft", eval_cfg={"datasets": ["gsm8k"], "lm_eval": {
        "tasks": {"IFEval": {"task": "ifeval", "metric": "prompt_level_loose_acc"}}}})
    [cell] = {c.source for c in collect.load_ours([Path(run)])}
    assert cell == "mixed"


# ------------------------------------------------------------------------------------------------------------
# DenseMixer: the GSM / CodeAlpaca / Nemotron-code layout


PRESETS = {("GSM", "olmoe_0125"): "gsm_olmoe", ("GSM", "qwen1_5_moe"): "gsm_qwen1_5",
           ("CodeAlpaca", "olmoe_0125"): "codealpaca_olmoe", ("CodeAlpaca", "qwen1_5_moe"): "codealpaca_qwen1_5",
           ("Nemotron code", "qwen3_30b_a3b_base"): "nemotron_code_qwen3_base"}


def test_densemixer_tables_follow_the_presets_and_hold_no_values():
    rows = [r for r in collect.load_reported("densemixer") if r["table"] in {t for t, _ in PRESETS}]
    assert {(r["table"], r["model"]) for r in rows} == set(PRESETS)
    for (table, model), preset in PRESETS.items():
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"experiment=densemixer/{preset}"],
                          return_hydra_config=True)
        mine = [r for r in rows if (r["table"], r["model"]) == (table, model)]
        assert {r["benchmark"] for r in mine} == set(cfg.eval.lm_eval.tasks), preset
        assert {r["train"] for r in mine} == {cfg.hydra.runtime.choices.dataset} and cfg.model.name == model
        methods = {r["row"] for r in mine}
        assert methods >= {"sft", "densemixer"}
        assert len(mine) == len(methods) * len(cfg.eval.lm_eval.tasks)  # every row x every column, once
    assert all(r["value"] is None and "not in specs" in r["source"] for r in rows)


def test_densemixer_rows_print_na(tmp_path, capsys):
    """A GSM run is matched to its paper cell (paper n/a) and the other new tables are listed with --all."""
    train = tmp_path / "train"
    (train / ".hydra").mkdir(parents=True)
    (train / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      dataset: gsm8k_train\n")
    (train / "export").mkdir()
    run = tmp_path / "ev"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "table": [{"model": "olmoe_0125", "method": "densemixer", "column": "GSM", "value": 31.5, "averaged": True}],
        "columns": ["GSM"], "limit": None, "checkpoint": str(train / "export")}))
    assert collect.main(["densemixer", str(run), "--all"]) == 0
    out = capsys.readouterr().out
    lines = [[p.strip() for p in line.split("|")] for line in out.splitlines() if line.startswith("| ")]
    gsm = [p for p in lines if p[1:5] == ["OLMoE-1B-7B", "DenseMixer", "gsm8k_train", "GSM"]]
    assert [p[6:9] for p in gsm] == [["n/a", "31.50", "n/a"]]
    for table in ("### GSM", "### CodeAlpaca", "### Nemotron code"):
        assert table in out
    nemotron = [p for p in lines if p[3] == "nemotron_code"]
    assert len(nemotron) == 6 and all(p[6:9] == ["n/a", "n/a", "n/a"] for p in nemotron)
