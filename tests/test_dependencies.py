"""pyproject's dependency ranges against constraints.txt (the exact set CI ran the suite on), and the version report
.ci/run prints (scripts/stack_versions.py)."""

from __future__ import annotations

import importlib.util

import pytest
from packaging.requirements import Requirement

from tests.conftest import ROOT

tomllib = pytest.importorskip("tomllib")
FAST_MOVING = ("torch", "transformers", "lightning", "peft", "deepspeed", "lm-eval")


def _stack_versions():
    spec = importlib.util.spec_from_file_location("stack_versions", ROOT / "scripts" / "stack_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    return {_stack_versions().canonical(r.name): r for r in reqs}


def test_constraints_satisfy_pyproject_and_upper_bounds_are_the_tested_releases():
    pins = _stack_versions().pinned()
    reqs = _requirements()
    for name, req in reqs.items():
        assert name in pins, f"{name} is a dependency but not in constraints.txt"
        assert req.specifier.contains(pins[name]), f"constraints.txt {name}=={pins[name]} is outside {req}"
    for name in FAST_MOVING:
        uppers = [s for s in reqs[name].specifier if s.operator in ("<", "<=")]
        assert uppers, f"pyproject: {name} has no upper bound"
        if name != "torch":  # torch: <2.14, the tested 2.13.x line
            assert {(s.operator, s.version) for s in uppers} == {("<=", pins[name])}, reqs[name]


def test_stack_report_names_each_package_and_flags_drift(tmp_path):
    module = _stack_versions()
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# header\ntorch==0.0.1  # comment\nTransformers==" + module.installed("transformers") + "\n")
    pins = module.pinned(constraints)
    assert pins == {"torch": "0.0.1", "transformers": module.installed("transformers")}
    lines = module.report(pins)
    assert [line.split()[0] for line in lines] == ["python", *module.STACK]
    flagged = [line.split()[0] for line in lines if "constraints.txt:" in line]
    assert flagged == ["torch"]
