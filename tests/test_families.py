"""Every MoE model type of the installed transformers is supported, refused or not looked at; the README matrix is
the code's."""

from __future__ import annotations

import pytest

import moe_lab
from moe_lab import families
from moe_lab.moe.registry import FAMILIES, supported_families
from tests.conftest import ROOT, build_tiny


def test_every_moe_model_type_has_a_state():
    states = families.family_states()
    unknown = sorted(t for t, (state, _) in states.items() if state == "unknown")
    assert not unknown, f"new MoE model types in transformers, in no state: {unknown}"
    # the static scan finds every registry family (each builds its sparse-MoE block under self.experts)
    assert set(supported_families()) <= set(states)
    assert len(states) >= len(FAMILIES) + len(families.REFUSED)


def test_refused_and_not_looked_at_are_current_and_disjoint():
    moe = set(families.moe_model_types())
    listed = set(families.REFUSED) | set(families.NOT_LOOKED_AT)
    assert not set(families.REFUSED) & set(families.NOT_LOOKED_AT)
    assert not listed & set(FAMILIES), "a supported family is also listed as refused / not looked at"
    assert listed <= moe, f"no longer MoE causal-LM model types: {sorted(listed - moe)}"
    assert all(reason.strip() for reason in (*families.REFUSED.values(), *families.NOT_LOOKED_AT.values()))


def test_readme_matrix_is_current():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert families.readme_with_matrix(text) == text, "run: python -m moe_lab.families --write-readme"


def test_matrix_cells_come_from_the_method_checks():
    markdown = families.markdown()
    row = next(line for line in markdown.splitlines() if line.startswith("| phimoe |"))
    assert "no: sparsemixer routing already has its own router-gradient estimator" in row
    gpt_oss = next(line for line in markdown.splitlines() if line.startswith("| gpt_oss |"))
    assert gpt_oss.rstrip(" |").endswith("no: condensed layers support the gate_up and w1_v1_w2 expert layouts only "
                                         "(GPT-OSS's clamped GLU with biases is not implemented) | yes")


@pytest.mark.parametrize("method,match", [("densemixer", "densemixer is not defined for phimoe: sparsemixer"),
                                          ("condenser", "condenser is not defined for phimoe: selection biases")])
def test_undefined_method_is_refused_by_name(method, match):
    with pytest.raises(ValueError, match=match):
        moe_lab.apply(build_tiny("phimoe"), method)
