"""experiments.collect: a paper's hub-task average is never compared with an average over other tasks, and the
DenseMixer table layout (its ESFT-task and Qwen3 tables against the presets' columns).

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
from moe_lab.eval.lm_eval_table import task_source
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
# DenseMixer: the ESFT-task tables (7, 8) and the Qwen3 S1 + Nemotron-code tables (2, 3)


PRESETS = {"olmoe_0125": ("gsm_olmoe", "codealpaca_olmoe"), "qwen1_5_moe": ("gsm_qwen1_5", "codealpaca_qwen1_5"),
           "qwen3_30b_a3b_base": ("nemotron_code_qwen3_base",)}


def test_densemixer_cells_cover_every_preset_column():
    """Every column a DenseMixer preset evaluates has a paper cell for the preset's model and training set, for
    every trained row of the paper; the paper's extra columns (LiveCodeBench, Olympiad) print ours n/a."""
    rows = collect.load_reported("densemixer")
    for model, presets in PRESETS.items():
        for preset in presets:
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                cfg = compose(config_name="config", overrides=[f"experiment=densemixer/{preset}"],
                              return_hydra_config=True)
            assert cfg.model.name == model
            mine = [r for r in rows if r["model"] == model and r["train"] == cfg.hydra.runtime.choices.dataset]
            methods = {r["row"] for r in mine}
            assert methods >= {"sft", "densemixer"}, preset
            for method in methods:
                for table in {r["table"] for r in mine} - collect.COST_TABLES:  # Table 6: training times
                    cells = {r["benchmark"] for r in mine if r["row"] == method and r["table"] == table}
                    assert cells >= set(cfg.eval.lm_eval.tasks), (preset, method, table)


def test_densemixer_rows_print_the_paper(tmp_path, capsys):
    """A GSM run is matched to its paper cell (Table 7, OLMoE DenseMixer GSM 49.00) and the other tables are
    listed with --all."""
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
    assert [p[6:9] for p in gsm] == [["49.00", "31.50", "-17.50"]]
    assert "### ESFT tasks" in out and "### Qwen3 S1 + Nemotron code (T=0.6, top-p=0.95)" in out
    # 3 decodings x 2 trained rows x 4 code columns (and Table 6's training times: a cost table)
    nemotron = [p for p in lines if p[3] == "nemotron_code" and p[4] not in ("Training time", "Overhead")]
    assert len(nemotron) == 24 and all(p[7:9] == ["n/a", "n/a"] and p[6] != "n/a" for p in nemotron)
    # the base rows' Avg. (Table 3) is a mean of the 4 code sets, not of the 9: flagged, marked and listed
    assert "| Qwen3-30B-A3B-Base | Base Model |  | Avg. | mean of 9 | 48.94! |" in out
    assert "- ! Qwen3-30B-A3B-Base / Base Model / Avg.: Avg. 48.94 is not the mean of the row's 9 sets" in out
