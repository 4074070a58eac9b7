"""What ``python run.py`` prints when moe-lab refuses a command: the message and its fix last, no traceback
(unless ``HYDRA_FULL_ERROR=1``); a misspelt key names the nearest known one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import InstantiationException

from moe_lab.data.sources import open_dataset
from moe_lab.runtime.error_report import own_check
from tests.conftest import ROOT

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
    assert lines[-2].startswith("ValueError raised at moe_lab/runtime/preflight.py:")
    assert "Traceback" not in proc.stderr + proc.stdout
    log = (tmp_path / "run" / "run.log").read_text()
    assert "Traceback" in log and "is not a number" in log  # the traceback is kept in the run's log


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
