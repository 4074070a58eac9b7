"""lm-eval hub task names keep lm-eval's own definitions: moe-lab's LLM-Adapters tasks are ``llm_adapters_*``
and never shadow them (offline: the task objects are built up to their dataset download, which is stopped)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from moe_lab.eval import lm_eval_bridge
from moe_lab.eval.lm_eval_bridge import PREFIX, evaluate_with_lm_eval, local_tasks, task_manager
from tests.conftest import DATA_DIR

# the benchmarks of the CD-MoE table that also have an LLM-Adapters version here, plus the other overlaps
HUB = ["arc_challenge", "boolq", "openbookqa", "piqa", "winogrande", "arc_easy", "gsm8k"]


class _Stop(Exception):
    """Raised instead of downloading a task's dataset: the task's config is complete by then."""


def _lm_eval_yaml_field(task: str, field: str) -> str:
    """The oracle: ``field`` of the installed lm-eval YAML whose ``task:`` line is ``task`` (one ``include:``
    followed), read as text, without lm-eval's loader."""
    import lm_eval

    for path in sorted((Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        if re.search(rf"^task:\s*{task}\s*$", text, re.MULTILINE):
            found = re.search(rf"^{field}:\s*(\S+)\s*$", text, re.MULTILINE)
            if found:
                return found.group(1)
            include = re.search(r"^include:\s*(\S+)\s*$", text, re.MULTILINE).group(1)
            return re.search(rf"^{field}:\s*(\S+)\s*$", (path.parent / include).read_text(), re.MULTILINE).group(1)
    raise AssertionError(f"lm-eval has no task {task}")


def _built_config(manager, task: str, monkeypatch) -> object:
    """The config of the task object lm-eval builds for ``task`` (stopped at its download)."""
    from lm_eval.api.task import ConfigurableTask

    seen = []

    def stop(self, *args, **kwargs):
        seen.append(self.config)
        raise _Stop

    monkeypatch.setattr(ConfigurableTask, "download", stop)
    with pytest.raises(_Stop):
        manager.load([task])
    return seen[0]


@pytest.mark.slow
def test_hub_names_are_lm_evals_own_tasks_without_override(caplog, monkeypatch):
    lm_eval_bridge._manager.cache_clear()  # index here, under caplog
    with caplog.at_level(logging.DEBUG):
        manager = task_manager([*HUB, "hellaswag", "llm_adapters_boolq"], hub_tasks=True, data_dir=DATA_DIR)
    assert not [r for r in caplog.records if "overrides existing task" in r.getMessage()]
    for task in HUB:
        config = _built_config(manager, task, monkeypatch)
        assert config.task == task
        assert config.dataset_path == _lm_eval_yaml_field(task, "dataset_path"), task
        assert config.custom_dataset is None and not Path(str(config.dataset_path)).exists()
        assert "llm_adapters" not in str(manager.task_index[task].yaml_path)
    # the LLM-Adapters versions in the same index: the local loader over the local test file
    config = _built_config(manager, "llm_adapters_boolq", monkeypatch)
    assert config.custom_dataset.__name__ == "load_choice_docs" and config.dataset_kwargs == {"eval_set": "boolq"}
    assert config.metadata["data_dir"] == str(DATA_DIR)
    assert Path(manager.task_index["llm_adapters_boolq"].yaml_path).parent == lm_eval_bridge.TASK_DIR


def test_override_warning_is_seen_by_caplog(caplog, tmp_path):
    """Control for the test above: a colliding name does log lm-eval's warning, and caplog records it."""
    from lm_eval.tasks._index import TaskIndex

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "t.yaml").write_text("task: boolq\ndataset_path: x\noutput_type: multiple_choice\n")
    with caplog.at_level(logging.WARNING):
        TaskIndex.build([tmp_path / "a", tmp_path / "b"])
    assert [r for r in caplog.records if "overrides existing task" in r.getMessage()]


def test_local_tasks_carry_the_prefix_and_no_hub_name():
    assert local_tasks() and all(t.startswith(PREFIX) for t in local_tasks())
    for path in lm_eval_bridge.TASK_DIR.glob("[!_]*.yaml"):
        assert re.search(rf"^task: {path.stem}$", path.read_text(), re.MULTILINE), path


def test_old_and_unknown_names_are_named():
    with pytest.raises(ValueError, match=r"'boolq' is lm-eval's own.*hub_tasks=True.*'llm_adapters_boolq'"):
        evaluate_with_lm_eval(None, None, ["boolq"], data_dir=DATA_DIR)
    with pytest.raises(ValueError, match=r"unknown lm-eval task.*'hellaswag'.*hub_tasks=True"):
        task_manager(["hellaswag"], hub_tasks=False)
    with pytest.raises(FileNotFoundError, match="data_dir"):
        task_manager(["llm_adapters_piqa"], data_dir="/nonexistent/llm_adapters")


@pytest.mark.slow
def test_unknown_hub_name_is_named():
    with pytest.raises(ValueError, match=r"unknown lm-eval task.*'no_such_task'.*lm_eval ls tasks"):
        task_manager(["boolq", "no_such_task", "llm_adapters_boolq"], hub_tasks=True, data_dir=DATA_DIR)
    with pytest.raises(ValueError, match=r"unknown lm-eval task.*'svamp'.*LLM-Adapters version is llm_adapters_svamp"):
        task_manager(["svamp", "llm_adapters_boolq"], hub_tasks=True, data_dir=DATA_DIR)
