"""The method registry: one registration per name (a second function under a taken name is refused, naming both
modules; the same function again is not), and a run config's installer found by its method."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import moe_lab.methods  # noqa: F401  (fills the registry)
from moe_lab.methods.registry import METHODS, method_of, register_adapter, register_method
from moe_lab.methods.sft import install_sft


def test_a_second_function_under_a_taken_name_is_refused():
    with pytest.raises(ValueError, match=r"method 'sft' is registered twice: moe_lab.methods.sft and "):
        register_method("sft")(lambda patch: None)
    with pytest.raises(ValueError, match=r"adapter 'lora' is registered twice: moe_lab.methods.lora and "):
        register_adapter("lora")(lambda patch, base_parameters: None)
    assert register_method("sft", expert_parallel=True)(install_sft) is install_sft  # the module imported again
    assert METHODS["sft"].install is install_sft


def test_method_of_a_run_config():
    assert method_of(OmegaConf.create({"method": {"name": "sft_aux_free", "method": "sft"}})) is METHODS["sft"]
    assert method_of(OmegaConf.create({"method": {"name": "kd"}})) is None
