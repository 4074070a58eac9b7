"""A clone of the repository alone is complete: nothing names a folder outside it, the data its defaults read
ships inside the package (with its licence), and the default data folder is that copy."""

from __future__ import annotations

import fnmatch
import subprocess

import tomllib
from hydra import compose, initialize_config_dir

from moe_lab.data.shipped import LLM_ADAPTERS_DIR
from tests.conftest import ROOT

OUTSIDE = ".." + "/shared"  # the development machine's folder beside the clone (spelled so this file does not name it)
SETS = ["AQuA", "ARC-Challenge", "ARC-Easy", "AddSub", "MultiArith", "SVAMP", "SingleEq", "boolq", "gsm8k", "mawps",
        "openbookqa", "piqa", "social_i_qa", "winogrande"]


def tracked_files() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def test_no_tracked_file_names_the_folder_beside_the_clone():
    naming = []
    for name in tracked_files():
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        naming += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1) if OUTSIDE in line]
    assert not naming, f"these lines read a folder a user's clone does not have: {naming}"


def test_the_llm_adapters_files_ship_with_their_licence_and_are_package_data():
    names = sorted(p.name for p in LLM_ADAPTERS_DIR.iterdir())
    assert [f"{s}.test.json" for s in SETS] + ["LICENSE.LLM-Adapters", "README.md", "math_data.json"] == \
        sorted(names, key=lambda n: (not n.endswith(".test.json"), n))
    assert "Apache License" in (LLM_ADAPTERS_DIR / "LICENSE.LLM-Adapters").read_text()
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["moe_lab.data"]
    for name in names:  # a wheel or a non-editable install carries every file
        assert any(fnmatch.fnmatch(f"files/llm_adapters/{name}", g) for g in globs), name
    assert all(f"moe_lab/data/files/llm_adapters/{n}" in tracked_files() for n in names)


def _data_dir(monkeypatch, env: str | None, overrides=()) -> str:
    if env is None:
        monkeypatch.delenv("MOE_LAB_DATA_DIR", raising=False)
    else:
        monkeypatch.setenv("MOE_LAB_DATA_DIR", env)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["dataset=math_data", "eval=math7", *overrides])
    assert cfg.eval.data_dir == cfg.paths.data_dir
    if not overrides:  # the dataset group stands alone: $MOE_LAB_DATA_DIR, else the packaged copy
        assert cfg.dataset.path == f"{cfg.paths.data_dir}/math_data.json"
    return cfg.paths.data_dir


def test_the_default_data_folder_is_the_packaged_copy_and_can_be_pointed_elsewhere(monkeypatch):
    assert _data_dir(monkeypatch, None) == str(LLM_ADAPTERS_DIR)
    assert _data_dir(monkeypatch, "/data/llm_adapters") == "/data/llm_adapters"
    assert _data_dir(monkeypatch, None, ["paths.data_dir=/elsewhere"]) == "/elsewhere"
