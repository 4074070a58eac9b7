"""A method's option defaults are written in two places, its installer's signature (``moe_lab.apply``, the Python
API) and its config (``conf/method/<method>.yaml``, ``run.py``): they must agree, so a run and a Python call of the
same method with no options are the same method. A variant config (one built on another config of the same
installer, e.g. condenser_public_code on condenser) exists to choose other values: only its keys are checked. KD and condense_sft hand their
options to their own modules, not to an installer."""

from __future__ import annotations

import functools
import inspect

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import moe_lab.methods  # noqa: F401 - fills the registry
from moe_lab.methods.registry import METHODS
from tests.conftest import ROOT

METHOD_DIR = ROOT / "conf" / "method"
CONFIGS = sorted(p.stem for p in METHOD_DIR.glob("*.yaml"))
#: modules whose ``options`` are the installer's keyword arguments (ESFT's module takes out ``experts`` first)
INSTALLER_OPTIONS = ("moe_lab.methods.base.MoELightningModule", "moe_lab.methods.esft_module.ESFTLightningModule",
                     "moe_lab.methods.condenser_module.CondenserModule")


@functools.cache
def _method(name: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[f"method={name}"]).method


def _variant(name: str) -> bool:
    """Whether the config builds on another config of the same installer (condenser_public_code on condenser)."""
    defaults = yaml.safe_load((METHOD_DIR / f"{name}.yaml").read_text()).get("defaults") or []
    method = _method(name).get("method")
    return any(isinstance(d, str) and d in CONFIGS and _method(d).get("method") == method for d in defaults)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_methods_config_and_its_installer_share_their_defaults(name):
    cfg = _method(name)
    if cfg.get("_target_") not in INSTALLER_OPTIONS:
        pytest.skip(f"method={name}: {cfg.get('_target_')} reads its options itself")
    installer = METHODS[cfg.method].install
    options = cfg.get("options")
    options = OmegaConf.to_container(options, resolve=True) if isinstance(options, DictConfig) else dict(options or {})
    parameters = inspect.signature(installer).parameters
    unknown = sorted(set(options) - set(parameters))
    assert not unknown, f"conf/method/{name}.yaml options {unknown} are no parameter of {installer.__name__}"
    if _variant(name):
        return  # its own choices, by design
    differ = {k: (v, parameters[k].default) for k, v in options.items()
              if parameters[k].default is not inspect.Parameter.empty and parameters[k].default != v}
    assert not differ, f"conf/method/{name}.yaml (yaml, signature): {differ}"


def test_every_base_method_is_checked():
    bases = {n for n in CONFIGS if not _variant(n) and _method(n).get("_target_") in INSTALLER_OPTIONS}
    assert bases == {"sft", "condenser", "densemixer", "esft_token", "compressed_experts", "frozen_router"}, bases
    assert _variant("condenser_public_code") and _variant("esft_token_densemixer")
