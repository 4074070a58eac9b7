"""ESFT method configs: the paper's thresholds and DenseMixer's ESFT port, composed by Hydra and built."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import moe_lab
from moe_lab.methods.esft import esft_parameter_groups
from moe_lab.moe.view import find_moe_layers
from tests.conftest import ROOT, build_tiny


def _method(name: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[f"method={name}"]).method


@pytest.mark.parametrize("name,score,p", [("esft_gate", "gate", 0.1), ("esft_token", "token", 0.2),
                                          ("esft_token_densemixer", "token", 0.4)])
def test_thresholds_are_the_papers(name, score, p):
    """ESFT paper section 4: p = 0.1 (ESFT-Gate), 0.2 (ESFT-Token); DenseMixer's port: 0.4."""
    method = _method(name)
    assert (method.name, method.score, method.p) == (name, score, p)
    trains_more = name == "esft_token_densemixer"
    assert method.options.train_lm_head == method.options.train_shared_experts == trains_more
    assert not method.options.train_router and not method.options.train_attention


def test_densemixer_port_trains_lm_head_and_shared_experts():
    model = build_tiny("qwen2_moe")
    experts = {view.index: [0] for view in find_moe_layers(model)}
    options = OmegaConf.to_container(_method("esft_token_densemixer").options)
    groups = esft_parameter_groups(moe_lab.apply(model, "esft", **{**options, "experts": experts}))
    for group in ("lm_head", "shared_experts"):
        assert groups[group] and all(p.requires_grad for _, p in groups[group]), group
    for group in ("router", "attention", "embeddings", "norms"):
        assert not any(p.requires_grad for _, p in groups[group]), group
