"""docs/how-to-add.md, followed on a copy of the repository: a toy task is its run, its row and its config; a toy
method is its module and its config. Nothing else is edited, and both run through ``run.py`` as a user types them.
The method's facts reach the plan, the support matrix and the EP refusal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

TOY_TASK = '''"""task=toy_count: the parameters of ``cfg.model``, counted and written to count.json."""

from __future__ import annotations

from pathlib import Path

from ..core.atomic import atomic_write_json
from ..models import load_model


def toy_count(cfg) -> dict:
    model, _ = load_model(cfg.model)
    summary = {"parameters": sum(p.numel() for p in model.parameters())}
    atomic_write_json(Path(cfg.paths.output_dir) / "count.json", summary)
    print(f"==== toy_count: {summary['parameters']:,} parameters", flush=True)
    return summary
'''
TOY_TASK_CONFIG = """# @package _global_
# A toy task (docs/how-to-add.md): counts the model's parameters into count.json.
task:
  name: toy_count
"""
TOY_ROW = '    Task("toy_count", "moe_lab.tasks.toy_count:toy_count"),\n'
TOY_METHOD = '''"""Router-only fine-tuning: every weight frozen but the routers' (a toy method, docs/how-to-add.md)."""

from __future__ import annotations

from ..moe.patch import MoEPatch
from .registry import register_method


def plan_lines(cfg, length) -> list[str]:
    return ["toy: every weight but the routers' frozen"]


@register_method("toy_router_only", plan_lines=plan_lines)
def install_toy_router_only(patch: MoEPatch, train_router_bias: bool = True) -> None:
    """Freeze every weight, then train the routers (and their biases unless ``train_router_bias=False``)."""
    for parameter in patch.model.parameters():
        parameter.requires_grad_(False)
    for view in patch.views:
        view.router_weight.requires_grad_(True)
        if train_router_bias and view.router_bias is not None:
            view.router_bias.requires_grad_(True)
'''
TOY_METHOD_CONFIG = """# A toy method (docs/how-to-add.md): only the routers train.
defaults:
  - sft
  - _self_
name: toy_router_only
method: toy_router_only
options:
  train_router_bias: true
"""
CHECK = """
import json, moe_lab, torch
from moe_lab import families
from moe_lab.models import load_model
from omegaconf import OmegaConf
model, _ = load_model(OmegaConf.load("conf/model/tiny_olmoe.yaml"))
moe_lab.apply(model, "toy_router_only")
print(json.dumps({"trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
                  "columns": list(families.COLUMNS), "olmoe": families.matrix_row("olmoe")["toy_router_only"]}))
"""


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """The repository's package, configs and entry point, plus the toy task and method (only the files the page
    names are written or edited)."""
    repo = tmp_path_factory.mktemp("repo")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("moe_lab", "conf"):
        shutil.copytree(ROOT / folder, repo / folder, ignore=ignore)
    shutil.copy2(ROOT / "run.py", repo / "run.py")
    (repo / "moe_lab/tasks/toy_count.py").write_text(TOY_TASK)
    (repo / "conf/task/toy_count.yaml").write_text(TOY_TASK_CONFIG)
    table = repo / "moe_lab/core/task_table.py"
    text = table.read_text()
    last = text.index("\n)}\n")
    table.write_text(text[: last + 1] + TOY_ROW + text[last + 1:])
    (repo / "moe_lab/methods/toy_router_only.py").write_text(TOY_METHOD)
    (repo / "conf/method/toy_router_only.yaml").write_text(TOY_METHOD_CONFIG)
    return repo


def _run(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def test_the_page_names_what_the_copy_adds():
    page = (ROOT / "docs" / "how-to-add.md").read_text()
    for piece in ("moe_lab/tasks/<name>.py", "moe_lab/core/task_table.py", "conf/task/<name>.yaml",
                  "moe_lab/methods/<name>.py", "conf/method/<name>.yaml", "@register_method"):
        assert piece in page


def test_a_toy_task_runs_from_its_run_row_and_config(copy, tmp_path):
    out = tmp_path / "count"
    proc = _run(copy, "run.py", "task=toy_count", "model=tiny_olmoe", f"hydra.run.dir={out}")
    from moe_lab.models import load_model  # the repository's own, for the independent count

    model, _ = load_model(OmegaConf.load(ROOT / "conf" / "model" / "tiny_olmoe.yaml"))
    expected = sum(p.numel() for p in model.parameters())
    assert json.loads((out / "count.json").read_text()) == {"parameters": expected}
    assert f"==== toy_count: {expected:,} parameters" in proc.stdout
    assert OmegaConf.load(out / "config.yaml").task.name == "toy_count"
    # its row says it keeps no partial work: task.resume refuses it, saying so
    refused = _run(copy, "run.py", f"task.resume={out}", check=False)
    assert refused.returncode != 0 and "task=toy_count run" in refused.stderr
    assert "it does not resume, run it again" in refused.stderr


def test_a_toy_method_trains_from_its_module_and_config(copy, tmp_path):
    facts = json.loads(_run(copy, "-c", CHECK).stdout.strip().splitlines()[-1])
    assert facts["trainable"] and all(".gate." in n or n.endswith(".gate.weight") for n in facts["trainable"])
    assert "toy_router_only" in facts["columns"] and facts["olmoe"] == "yes"

    plan = _run(copy, "run.py", "method=toy_router_only", "debug=fast", "plan=true", f"hydra.run.dir={tmp_path / 'p'}")
    assert "toy: every weight but the routers' frozen" in plan.stdout
    ep = _run(copy, "run.py", "method=toy_router_only", "debug=fast", "hardware=ddp_cpu_ep", "plan=true",
              f"hydra.run.dir={tmp_path / 'ep'}", check=False)
    assert ep.returncode != 0 and "method=toy_router_only under hardware.ep_size=2: not proven under expert " \
                                  "parallelism" in ep.stderr

    out = tmp_path / "train"
    _run(copy, "run.py", "method=toy_router_only", "debug=fast", f"hydra.run.dir={out}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "toy_router_only" and summary["global_step"] > 0
    # the export against the run's own starting weights (its seed, its model config): only the routers moved
    import lightning as L
    from transformers import AutoModelForCausalLM

    from moe_lab.models import load_model

    cfg = OmegaConf.load(out / "config.yaml")
    L.seed_everything(cfg.seed, workers=True)
    start = load_model(cfg.model)[0].state_dict()
    end = AutoModelForCausalLM.from_pretrained(out / "export").state_dict()
    moved = {name for name, value in end.items() if not torch.equal(value, start[name].to(value.dtype))}
    assert moved and moved == {name for name in moved if ".gate." in name}
    assert moved == {name for name in start if name.endswith(".mlp.gate.weight")}
