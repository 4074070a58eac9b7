"""The multirun summary table: job order, per-model step ratios, perplexity."""

from __future__ import annotations

import json
import math

from moe_lab.sweep_summary import sweep_rows, write_sweep_summary


def _job(root, name, model, method, step_time, val=1.0):
    d = root / name
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({
        "model": model, "method": method, "global_step": 3, "train/loss": 2.0, "val/loss": val,
        "step_time_median_s": step_time}))


def test_rows_in_job_order_with_ratios_to_the_same_models_sft(tmp_path):
    _job(tmp_path, "10_b_densemixer", "b", "densemixer", 0.3)
    _job(tmp_path, "2_a_densemixer", "a", "densemixer", 0.5)
    _job(tmp_path, "0_a_sft", "a", "sft", 0.4, val=0.5)
    _job(tmp_path, "1_b_sft", "b", "sft", 0.2)
    _job(tmp_path, "3_c_condenser", "c", "condenser", 0.1)
    rows = sweep_rows(tmp_path)
    assert [r["job"] for r in rows] == ["0_a_sft", "1_b_sft", "2_a_densemixer", "3_c_condenser", "10_b_densemixer"]
    ratio = {r["job"]: r["step_ratio"] for r in rows}
    assert ratio["2_a_densemixer"] == 0.5 / 0.4 and ratio["10_b_densemixer"] == 0.3 / 0.2
    assert ratio["3_c_condenser"] is None, "no sft job of that model: no ratio rather than a wrong one"
    assert rows[0]["val_ppl"] == math.exp(0.5)
    md = write_sweep_summary(tmp_path).read_text().splitlines()
    assert len(md) == 2 + 5 and "| 2_a_densemixer | a | densemixer | 3 |" in md[4]
    assert (tmp_path / "summary.csv").exists()
