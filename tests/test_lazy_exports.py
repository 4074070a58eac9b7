"""``moe_lab`` and ``moe_lab.data`` export their names lazily: importing the package (what ``run.py``'s override
check and Hydra's resolver need) loads no torch, Lightning or transformers, and every exported name resolves."""

from __future__ import annotations

import subprocess
import sys

import moe_lab
import moe_lab.data
from tests.conftest import ROOT


def test_the_override_check_loads_no_framework():
    code = ("import sys, moe_lab.runtime.override_keys; "
            "print(sorted(m for m in ('torch', 'lightning', 'transformers', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_every_exported_name_resolves():
    for package in (moe_lab, moe_lab.data):
        assert sorted(package.__all__) == sorted(package.EXPORTS), package.__name__
        for name in package.__all__:
            assert getattr(package, name) is not None, (package.__name__, name)
    assert moe_lab.apply.__module__ == "moe_lab.methods.registry"
