"""The GPU Dockerfile, checked without a Docker daemon: base image, torch pin against pyproject's range and the
CUDA wheel index against the base image's CUDA, install lines, entry point and .dockerignore."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.conftest import ROOT


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _args(instructions) -> dict[str, str]:
    return dict(rest.split("=", 1) for op, rest in instructions if op == "ARG" and "=" in rest)


def test_base_image_is_cuda_and_torch_wheel_matches_it_and_pyproject():
    ins = _instructions()
    assert ins[0][0] == "FROM"
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel-ubuntu\d+\.\d+", ins[0][1])
    assert match, ins[0][1]  # devel: DeepSpeed JIT-compiles its CUDA ops
    cuda = f"cu{match.group(1)}{match.group(2)}"
    args = _args(ins)
    assert args["TORCH_INDEX"] == f"https://download.pytorch.org/whl/{cuda}"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    assert torch_req.specifier.contains(args["TORCH_VERSION"]), (args["TORCH_VERSION"], str(torch_req))
    runs = [rest for op, rest in ins if op == "RUN"]
    torch_line = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    project_line = next(i for i, r in enumerate(runs) if 'pip install -e ".[dev]"' in r)
    assert torch_line < project_line and "--index-url \"${TORCH_INDEX}\"" in runs[torch_line]
    assert "import torch, deepspeed, lightning, transformers" in runs[project_line]


def test_sources_copied_after_install_and_entry_point_is_run_py():
    ins = _instructions()
    copies = [rest for op, rest in ins if op == "COPY"]
    for copy in copies[:-1]:  # what the install needs exists
        for src in copy.split()[:-1]:
            assert (ROOT / src).exists(), src
    assert copies[-1] == ". ."
    assert [json.loads(rest) for op, rest in ins if op == "ENTRYPOINT"] == [["python", "run.py"]]
    assert ins[-1][0] == "CMD" and json.loads(ins[-1][1])[0].startswith("hardware=")


def test_dockerignore_keeps_environments_and_outputs_out():
    rules = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    assert {".venv", "outputs", "multirun", "wandb", ".git", "lightning_logs"} <= rules
    for needed in ("moe_lab", "conf", "run.py", "pyproject.toml", "README.md"):
        assert needed not in rules and (ROOT / needed).exists()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True,
                                                                     check=False).returncode != 0,
                    reason="no Docker daemon")
def test_image_builds():
    subprocess.run(["docker", "build", "-t", "moe-lab:test", str(ROOT)], check=True, timeout=3600)
