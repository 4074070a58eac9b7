"""A plain task=condense run with lm-eval writes the results table + eval settings experiments.collect matches."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.compress import load_condensed
from tests.conftest import DATA_DIR, ROOT, word_text

TASKS = {"llm_adapters_boolq": "boolq", "llm_adapters_piqa": "piqa"}
LIMIT = 2


def _compose(out, *overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"paths.output_dir={out}", *overrides])


@pytest.fixture(scope="module")
def condensed(tmp_path_factory):
    """calibrate -> task=condense (CD-MoE-S, 1 layer) -> lm-eval on 2 rows of two LLM-Adapters tasks."""
    from moe_lab.tasks import run_task

    tmp = tmp_path_factory.mktemp("condense_collect")
    text = word_text(tmp / "c4.txt", 30)
    data = ["num_sequences=4", "seq_len=16", "batch_size=2", "sample=first"]
    cal = run_task(_compose(tmp / "cal", "task=calibrate", "model=tiny_deepseek_v2",
                            "dataset@compress.calibration.dataset=c4", f"compress.calibration.dataset.path={text}",
                            *[f"compress.calibration.{d}" for d in data]))
    cfg = _compose(tmp / "cd", "task=condense", "model=tiny_deepseek_v2", f"paths.data_dir={DATA_DIR}",
                   f"condense.calibration_file={cal['calibration']}", f"condense.search.dataset.path={text}",
                   "condense.routed_experts=0", "condense.num_layers=1", *[f"condense.search.{d}" for d in data],
                   f"condense.eval.tasks=[{','.join(TASKS)}]", f"condense.eval.limit={LIMIT}",
                   "condense.eval.hub_tasks=false", "condense.eval.batch_size=2")
    summary = run_task(cfg)
    (tmp / "cd" / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # as run.py writes it
    return cfg, summary, tmp


def _oracle(summary) -> dict[str, float]:
    """acc_norm in percent, scored by moe-lab's own log-likelihood code on the reloaded export (not lm-eval)."""
    from moe_lab.data.tokenizer import load_tokenizer
    from moe_lab.eval.likelihood import score_choices
    from moe_lab.eval.lm_eval_tasks.llm_adapters import load_choice_docs

    model = load_condensed(summary["export"]).eval()
    tokenizer = load_tokenizer(summary["export"])
    out = {}
    for task, eval_set in TASKS.items():
        docs = load_choice_docs(eval_set, DATA_DIR)["test"].select(range(LIMIT))
        with torch.no_grad():
            scored = score_choices(model, tokenizer, docs["context"], docs["choices"])
        out[task] = 100 * sum(s["pred_norm"] == g for s, g in zip(scored, docs["gold"])) / LIMIT
    return out


def test_condense_summary_holds_the_table_and_eval_settings(condensed):
    cfg, summary, _ = condensed
    assert cfg.get("eval") is None  # task=condense has no eval group: the settings live in summary.json
    expected = _oracle(summary)
    assert summary["columns"] == list(TASKS) and summary["limit"] == LIMIT
    assert summary["table"] == [{"model": "tiny_deepseek_v2", "method": "cd_moe_s", "column": task,
                                 "value": expected[task], "averaged": True} for task in TASKS]
    assert summary["eval_settings"] == {"name": "lm_eval", "layers": 1, "routed_experts": 0,
                                        "expert_selection": "greedy", "layer_selection": "greedy",
                                        "task_source": "llm_adapters"}
    assert len(summary["layers"]) == 1


def test_collector_matches_layers_and_s_vs_sr(condensed, capsys):
    from experiments import collect

    _, _, tmp = condensed
    reported = tmp / "reported.csv"
    rows = [("cd_moe_s", "layers=1;routed_experts=0", "40"), ("cd_moe_s", "layers=8", "50"),
            ("cd_moe_sr", "layers=1", "60")]
    with open(reported, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(collect.FIELDS)
        for row, cond, value in rows:
            writer.writerow(("Main", "Tiny", "tiny_deepseek_v2", row.upper(), row, "", cond, "Avg.", "acc", value,
                             "test"))
    assert collect.main(["condense", str(tmp / "cd"), "--reported", str(reported), "--all"]) == 0
    lines = {line.split("|")[2].strip() + line.split("|")[6].strip(): line.split("|")[6:9]
             for line in capsys.readouterr().out.splitlines() if "| CD_MOE_S" in line}
    # matched (layers=1), but the paper's Avg. is over lm-eval hub tasks and ours over LLM-Adapters ones: withheld
    assert lines["CD_MOE_S40.00"] == [" 40.00 ", " n/a\u2020 ", " n/a "]
    assert lines["CD_MOE_S50.00"][1].strip() == "n/a"  # another layer count
    assert lines["CD_MOE_SR60.00"][1].strip() == "n/a"  # S is not SR


def test_collector_names_a_condense_run_without_eval(tmp_path, capsys):
    from experiments import collect

    (tmp_path / "summary.json").write_text(json.dumps({"method": "cd_moe", "layers": [1]}))
    assert collect.main(["condense", str(tmp_path)]) == 2
    assert "condense.eval.tasks" in capsys.readouterr().err
