"""Documented overrides that Hydra's struct mode used to refuse: the open maps (``task.checkpoints.base=...``,
``eval.lm_eval.tasks={...}``, ``task.runs.<label>=``, ``task.logs.<label>=``) and ``method.teacher=<conf/model name>``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import run
from moe_lab.distill.teacher import load_teacher, teacher_spec
from tests.conftest import DATA_DIR, ROOT, build_tiny, tiny_model_cfg

CONF = ROOT / "conf"


def _compose(*argv: str):
    """The config ``python run.py <argv>`` composes (run.py's argv conveniences applied first)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=run.expand_argv(["run.py", *argv])[1:])


def test_correlation_checkpoints_accept_labels():
    cfg = _compose("task=correlation", "model=tiny_deepseek_v2", "task.checkpoints.base=/x/base",
                   "task.checkpoints.esft=/x/esft", "task.checkpoints.condenser=/x/cond")
    assert OmegaConf.to_container(cfg.task.checkpoints) == {"base": "/x/base", "esft": "/x/esft",
                                                            "condenser": "/x/cond"}
    run.check_open_maps(cfg, run.expand_argv(["run.py", "task=correlation", "task.checkpoints.base=/x/base"]))


def test_lm_eval_tasks_accept_columns_as_documented():
    argv = ["task=evaluate", "eval=math7", "eval.lm_eval.tasks={BoolQ: {task: boolq, metric: acc}}",
            "eval.lm_eval.tasks.PIQA={task: piqa, metric: acc_norm}"]
    cfg = _compose(*argv)
    assert OmegaConf.to_container(cfg.eval.lm_eval.tasks) == {"BoolQ": {"task": "boolq", "metric": "acc"},
                                                              "PIQA": {"task": "piqa", "metric": "acc_norm"}}
    run.check_open_maps(cfg, run.expand_argv(["run.py", *argv]))


@pytest.mark.parametrize("task,key", [("activation_stats", "task.runs.sft"), ("offload", "task.logs.sft")])
def test_other_open_maps_accept_labels(task, key):
    cfg = _compose(f"task={task}", f"{key}=/x/file")
    assert OmegaConf.select(cfg, key) == "/x/file"


def test_every_empty_map_of_a_task_or_eval_group_is_open():
    """A new ``{}`` map in conf/task or conf/eval must be in run.open_maps() (or its README override fails)."""
    declared = set()
    for path in [*(CONF / "task").glob("*.yaml"), *(CONF / "eval").glob("*.yaml")]:
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        group = path.parent.name
        node = cfg.get("task", {}) if group == "task" and "task" in cfg else cfg
        declared |= {key for key, value in _maps(node, group) if value == {}}
    assert declared == set(run.open_maps())


def _maps(node: dict, prefix: str):
    for key, value in node.items():
        if isinstance(value, dict):
            yield f"{prefix}.{key}", value
            yield from _maps(value, f"{prefix}.{key}")


@pytest.mark.parametrize("argv,message", [
    (["task.checkpoints.base=/x"], ("task.checkpoints.base: only task=correlation reads task.checkpoints (task.name "
                                    "is finetune); drop the override or add task=correlation")),
    (["task=evaluate", "eval.lm_eval.tasks={A: {task: boolq, metric: acc}}"],
     "eval.lm_eval.tasks: only an eval group reads eval.lm_eval.tasks"),
])
def test_an_open_map_of_a_config_not_chosen_is_refused(argv, message):
    expanded = run.expand_argv(["run.py", *argv])
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=expanded[1:])
    with pytest.raises(ValueError, match=re.escape(message)):
        run.check_open_maps(cfg, expanded)


def test_explicit_plus_and_other_keys_are_left_alone():
    assert run.expand_argv(["run.py", "+task.checkpoints.base=/x", "task.checkpoints_dir=/y", "model=tiny_olmoe"]) \
        == ["run.py", "+task.checkpoints.base=/x", "task.checkpoints_dir=/y", "model=tiny_olmoe",
            "hydra.output_subdir=null"]  # .hydra/ is written by run.py once it holds the run lock


# ----------------------------------------------------------------------------------------------------------------
# method.teacher=<conf/model entry name>


def test_teacher_by_conf_model_name_is_that_entry():
    """``method.teacher=tiny_qwen3_moe`` builds the same random model as the ``model=tiny_qwen3_moe`` entry."""
    from moe_lab.models import load_model

    assert teacher_spec("tiny_qwen3_moe") == OmegaConf.to_container(tiny_model_cfg("qwen3_moe"))
    teacher = load_teacher("tiny_qwen3_moe")
    reference, _ = load_model(tiny_model_cfg("qwen3_moe"), dense=True)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(teacher(input_ids=ids).logits, reference.eval()(input_ids=ids).logits)


def test_teacher_path_wins_and_unknown_name_names_method_teacher(tmp_path, monkeypatch):
    model = build_tiny("qwen3_moe")
    model.save_pretrained(tmp_path / "tiny_qwen3_moe")
    monkeypatch.chdir(tmp_path)
    assert teacher_spec("tiny_qwen3_moe") == {"pretrained": "tiny_qwen3_moe", "tokenizer": "tiny_qwen3_moe"}
    with pytest.raises(FileNotFoundError, match=r"method.teacher=tiny_qwen3: neither a conf/model entry \(.*"
                                                r"tiny_qwen3_moe.*\) nor an existing checkpoint folder"):
        load_teacher("tiny_qwen3")


def test_teacher_hub_id_offline_names_method_teacher(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=r"^method.teacher=org/not-a-model: .*method.teacher=/local/path"):
        load_teacher("org/not-a-model")


# ----------------------------------------------------------------------------------------------------------------
# The documented overrides through run.py


def _run_py(tmp_path, *argv):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "MOE_LAB_DATA_DIR": str(DATA_DIR)}
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *argv, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((tmp_path / "run" / "summary.json").read_text())


@pytest.mark.slow
def test_correlation_command_as_documented(tmp_path):
    """``task.checkpoints.{base,esft,condenser}=<exports>`` on the command line, three tiny OLMoE exports."""
    for i, name in enumerate(("base", "esft", "condenser")):
        build_tiny("olmoe", seed=i).save_pretrained(tmp_path / name)
    summary = _run_py(tmp_path, "task=correlation", "model=tiny_olmoe", *(f"task.checkpoints.{n}={tmp_path / n}" for n in
                      ("base", "esft", "condenser")), "task.condensers={0: [2, 5], 1: [0, 1]}")
    assert {"correlation/esft/mean", "correlation/condenser/mean"} <= set(summary)
    assert (tmp_path / "run" / "correlation.png").is_file()


@pytest.mark.slow
def test_lm_eval_columns_as_documented(tmp_path):
    """``eval.lm_eval.tasks={column: {task, metric}}`` adds that column (moe-lab's local BoolQ task, 2 rows)."""
    summary = _run_py(tmp_path, "task=evaluate", "eval=math7", "eval.datasets=[gsm8k]", "eval.limit=2",
                      "eval.generation.max_new_tokens=4", "eval.lm_eval.hub_tasks=false",
                      "eval.lm_eval.tasks={BoolQ: {task: llm_adapters_boolq, metric: acc}}")
    columns = {row["column"]: row["value"] for row in summary["table"]}
    assert set(columns) >= {"GSM8K", "BoolQ"} and 0 <= columns["BoolQ"] <= 100
