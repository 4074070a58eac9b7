"""End to end through run.py: the default task, frozen router, a -m grid, DDP on 2 CPUs, bad names."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def run_py(*overrides, cwd: Path, check=True, timeout=600):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"run.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _column(path: Path, name: str) -> list[float]:
    with open(path) as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def test_default_run_writes_config_metrics_plots_and_vanilla_export(tmp_path):
    out = tmp_path / "run"
    proc = run_py("debug=fast", f"hydra.run.dir={out}", cwd=tmp_path)
    assert f"Output directory: {out}" in proc.stdout
    # Lightning's own log lines print once and reach run.log
    assert (proc.stdout + proc.stderr).count("`Trainer.fit` stopped") == 1
    assert (out / "run.log").read_text().count("`Trainer.fit` stopped") == 1
    config = OmegaConf.load(out / "config.yaml")
    assert config.model.name == "tiny_olmoe" and config.method.name == "sft" and config.task.name == "finetune"
    losses = _column(out / "metrics.csv", "train/loss")
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert _column(out / "metrics.csv", "load/layer0/gini") and _column(out / "metrics.csv", "grad_norm/router")
    assert (out / "plots" / "train_loss.png").stat().st_size > 0
    assert (out / "plots" / "expert_load_latest.png").stat().st_size > 0
    assert (out / "checkpoints" / "last.ckpt").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "export")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "export")
    assert type(model).__name__ == "OlmoeForCausalLM"
    ids = tokenizer("2 + 3 =", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


def test_frozen_router_on_qwen3_keeps_router_weights(tmp_path):
    from moe_lab.models import load_model

    out = tmp_path / "run"
    run_py("model=tiny_qwen3_moe", "method=frozen_router", "debug=fast", f"hydra.run.dir={out}", cwd=tmp_path)
    initial, _ = load_model(OmegaConf.load(ROOT / "conf" / "model" / "tiny_qwen3_moe.yaml"))
    trained = transformers.AutoModelForCausalLM.from_pretrained(out / "export")
    before, after = initial.state_dict(), trained.state_dict()
    routers = [k for k in before if k.endswith("mlp.gate.weight")]
    experts = [k for k in before if k.endswith("experts.gate_up_proj")]
    assert routers and experts
    for key in routers:
        assert torch.equal(before[key], after[key]), key
    assert any(not torch.equal(before[k], after[k]) for k in experts)


GRID = ["sft", "frozen_router", "sft_aux_free", "esft_gate", "esft_token", "densemixer", "condenser",
        "compressed_experts"]


def test_multirun_grid_over_every_method_writes_one_summary_table(tmp_path):
    sweep = tmp_path / "sweep"
    run_py("-m", f"method={','.join(GRID)}", "debug=fast", "task.trainer.max_steps=3",
           "~callbacks.expert_load", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    runs = sorted((p for p in sweep.iterdir() if p.is_dir() and (p / "config.yaml").exists()),
                  key=lambda p: int(p.name.split("_")[0]))
    assert [OmegaConf.load(r / "config.yaml").method.name for r in runs] == GRID
    for r in runs:
        assert json.loads((r / "summary.json").read_text())["global_step"] == 3
        assert (r / "export" / "model.safetensors").exists()
    table = (sweep / "summary.md").read_text().splitlines()
    assert len(table) == 2 + len(GRID)
    rows = {line.split("|")[3].strip(): line for line in table[2:]}
    assert set(rows) == set(GRID)
    with open(sweep / "summary.csv") as f:
        ratios = {row["method"]: row["step_ratio"] for row in csv.DictReader(f)}
    assert float(ratios["sft"]) == 1.0 and all(float(v) > 0 for v in ratios.values())


@pytest.mark.parametrize("override,expected", [
    ("model=tiny_llama", "tiny_olmoe"),
    ("method=densemixr", "frozen_router"),
    ("dataset=gsm8kk", "synthetic_math"),
])
def test_unknown_group_option_lists_valid_ones(tmp_path, override, expected):
    proc = run_py(override, cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0
    assert expected in proc.stderr


def test_top_k_above_experts_fails_naming_the_field(tmp_path):
    proc = run_py("model.config.num_experts_per_tok=12", "debug=fast", f"hydra.run.dir={tmp_path / 'r'}",
                  cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0
    assert "num_experts_per_tok" in proc.stderr and "top_k=12" in proc.stderr
    assert (tmp_path / "r" / "config.yaml").exists()  # what was written before the error is kept
