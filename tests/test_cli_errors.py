"""What ``python run.py`` prints when moe-lab refuses a command: the message and its fix last, no traceback
(unless ``HYDRA_FULL_ERROR=1``); a misspelt key names the nearest known one."""

from __future__ import annotations

import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException

import run
from moe_lab.data.sources import open_dataset
from moe_lab.methods import distill
from moe_lab.methods.registry import METHODS
from moe_lab.runtime.error_report import own_check
from moe_lab.runtime.override_keys import check_override_keys
from tests.conftest import ROOT
from tests.test_readme_commands import readme_commands

RUN_PY = ROOT / "run.py"


def run_py(*overrides: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "WANDB_MODE": "offline",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, str(RUN_PY), *overrides], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def _raise_in_test():
    int("1k")


def _caught(function, *args) -> BaseException:
    try:
        function(*args)
    except Exception as error:  # noqa: BLE001 - the error is the result
        return error
    raise AssertionError(f"{function} raised nothing")


def test_own_check_is_a_check_raised_by_moe_lab_code(tmp_path):
    missing = _caught(open_dataset, str(tmp_path / "missing.json"))
    assert own_check(missing, RUN_PY) is missing
    wrapped = InstantiationException("Error in call to target 'x'")
    wrapped.__cause__ = missing
    assert own_check(wrapped, RUN_PY) is missing  # unwrapped from Hydra's instantiate
    assert own_check(_caught(_raise_in_test), RUN_PY) is None  # raised elsewhere: keeps its traceback
    assert own_check(_caught(lambda: [].pop()), RUN_PY) is None  # not a check's type


def test_bad_value_ends_with_its_message_and_no_traceback(tmp_path):
    proc = run_py("task.trainer.max_steps=1k", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1
    assert lines[-1] == ("Error: task.trainer.max_steps='1k' is not a number: write it out in digits, "
                         "e.g. task.trainer.max_steps=1000"), proc.stderr
    assert lines[-2].startswith("ValueError raised at moe_lab/core/settings.py:")  # the run length's own check
    assert "Traceback" not in proc.stderr + proc.stdout
    log = (tmp_path / "run" / "run.log").read_text()
    assert "Traceback" in log and "is not a number" in log  # the traceback is kept in the run's log


def test_a_trainer_argument_lightning_does_not_take_is_refused_before_anything_loads(tmp_path):
    """``+task.trainer.<x>`` passes any Trainer argument through; a misspelt one is refused by the preflight's
    loop check, naming the close ones, and no run directory content beyond the log is written."""
    proc = run_py("+task.trainer.num_node=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == ("Error: task.trainer.num_node is not an argument of Lightning's "
                                                    "Trainer; did you mean task.trainer.num_nodes?"), proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_hydra_full_error_keeps_the_traceback(tmp_path):
    proc = run_py("task.trainer.max_steps=1k", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                  HYDRA_FULL_ERROR="1")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "preflight.py" in proc.stderr
    assert "ValueError: task.trainer.max_steps='1k' is not a number" in proc.stderr


@pytest.mark.slow
def test_missing_data_path_ends_with_its_message(tmp_path):
    proc = run_py("dataset=math_data", f"dataset.path={tmp_path / 'nope.json'}", "debug=fast",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1
    assert lines[-1].startswith(f"Error: Dataset path '{tmp_path / 'nope.json'}' does not exist"), proc.stderr
    assert lines[-1].endswith("`dataset.path=/local/file.json`.")
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------------
# Misspelt keys


def _check(*args: str) -> None:
    check_override_keys(run.expand_argv(["run.py", *args])[1:], ROOT / "conf")


def _composes(*args: str) -> None:
    overrides = [a for a in run.expand_argv(["run.py", *args])[1:] if not a.startswith("-")]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("args,message,fixed", [
    (["task.trainer.max_stepz=3"],
     ("task.trainer.max_stepz is not a key of task=finetune; did you mean task.trainer.max_steps or "
      "task.trainer.max_epochs?"), "task.trainer.max_steps=3"),
    (["method=condenser", "method.options.gama=0.1"],
     "method.options.gama is not a key of method=condenser; did you mean method.options.gamma?",
     "method.options.gamma=0.1"),
    (["dataset=math_data", "dataset.max_lenght=64"],
     "dataset.max_lenght is not a key of dataset=math_data; did you mean dataset.max_length?",
     "dataset.max_length=64"),
    (["eval=ppl", "eval.batchsize=2"],
     "eval.batchsize is not a key of eval=ppl; did you mean eval.batch_size?", "eval.batch_size=2"),
    (["sed=1"], "sed is not a key of the config; did you mean seed?", "seed=1"),
])
def test_misspelt_key_names_the_nearest_known_one(args, message, fixed):
    with pytest.raises(ValueError) as refused:
        _check(*args)
    assert str(refused.value) == message
    _check(*args[:-1], fixed)  # the suggestion is a key Hydra composes
    _composes(*args[:-1], fixed)


def test_key_without_a_near_one_lists_the_keys_there():
    with pytest.raises(ValueError, match=r"task.optim.xyzzy is not a key of task=finetune; its keys under "
                                         r"task.optim: betas, eps, lr, weight_decay$"):
        _check("task.optim.xyzzy=1")
    with pytest.raises(ValueError, match=r"^method.options.gamma is not a key of method=sft: it has no keys under "
                                         r"method.options$"):
        _check("method.options.gamma=0.1")


@pytest.mark.parametrize("args", [
    ["+task.new_key=1"],  # a deliberate addition: Hydra's
    ["dataset=text", "dataset.path=train.txt"],  # a ??? value is a key
    ["-m", "method=sft,condenser", "task.trainer.max_stepz=3"],  # a sweep over a group: Hydra checks each job
    ["model=tiny_llama", "task.trainer.max_stepz=3"],  # an unknown group option: Hydra lists the valid ones
    ["--cfg", "job", "task.trainer.max_stepz=3"],  # Hydra's flags
])
def test_additions_and_what_hydra_reports_itself_are_left_to_hydra(args):
    _check(*args)


def test_every_readme_run_command_passes_the_key_check():
    checked = 0
    for command in readme_commands():
        tokens = shlex.split(re.sub(r"\$\([^)]*\)", "X", command))
        while re.match(r"^[A-Z_]+=", tokens[0]):
            tokens.pop(0)
        if tokens[:2] == ["python", "run.py"]:
            _check(*(t for t in tokens[2:] if not t.startswith("task.resume=")))  # <run> placeholders
            checked += 1
    assert checked > 40


def test_every_method_config_declares_the_options_its_code_accepts():
    """The key check refuses a method option its conf/method/*.yaml does not declare: each declares them all."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for path in sorted((ROOT / "conf" / "method").glob("*.yaml")):
            method = compose(config_name="config", overrides=[f"method={path.stem}"]).method
            if method._target_.endswith("KDModule"):
                accepted = set(distill.DEFAULTS)
            else:
                accepted = set(inspect.signature(METHODS[method.method].install).parameters) - {"patch"}
            assert accepted <= set(method.options), f"{path.name}: {sorted(accepted - set(method.options))}"


def test_misspelt_method_option_ends_with_the_nearest_one(tmp_path):
    proc = run_py("method=condenser", "method.options.gama=1", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == ("Error: method.options.gama is not a key of method=condenser; "
                                                    "did you mean method.options.gamma?")
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()  # refused before anything is written
