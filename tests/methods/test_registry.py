"""The method registry: one registration per name (a second function under a taken name is refused, naming both
modules; the same function again is not), and a run config's installer found by its method."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

import moe_lab.methods  # fills the registry
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


def test_a_module_file_holds_an_installer_or_a_lightning_module_never_both():
    """The file convention docs/how-to-add.md states: a method's installer is ``<name>.py``; its own LightningModule,
    when it has an installer too, ``<name>_module.py``; a method that is a LightningModule only (kd, condense_sft)
    is one file. So no file both registers an installer and defines a LightningModule (base.py: the shared one)."""
    import importlib
    import inspect
    import pkgutil

    import lightning as L

    installers = {spec.install.__module__ for spec in METHODS.values()}
    modules = {}
    for info in pkgutil.iter_modules(moe_lab.methods.__path__):
        module = importlib.import_module(f"moe_lab.methods.{info.name}")
        modules[info.name] = [c for c in vars(module).values() if inspect.isclass(c)
                              and issubclass(c, L.LightningModule) and c.__module__ == module.__name__]
    assert not [n for n, classes in modules.items() if classes and f"moe_lab.methods.{n}" in installers]
    for name in (n for n in modules if n.endswith("_module")):
        assert modules[name], f"{name}.py defines no LightningModule"
        assert f"moe_lab.methods.{name.removesuffix('_module')}" in installers, f"{name}.py has no installer beside it"
    assert {n for n, classes in modules.items() if classes} >= {"base", "condenser_module", "esft_module", "distill",
                                                               "condense_sft"}


def test_the_facts_a_run_reads_off_a_lightning_module_class():
    """kd trains dense students and is refused under EP; condense_sft's export carries the condensed manifest; the
    base states none of these (a method inherits them only by subclassing)."""
    from moe_lab.compress.condense import CONDENSE_FILE
    from moe_lab.core.method_class import module_class, module_fact
    from moe_lab.methods.base import MoELightningModule
    from moe_lab.methods.condense_sft import CondenseSFTModule
    from moe_lab.methods.distill import KDModule

    kd = OmegaConf.create({"_target_": "moe_lab.methods.distill.KDModule", "name": "kd"})
    assert module_class(kd) is KDModule and module_fact(kd, "trains_dense_models") is True
    assert KDModule.expert_parallel_refusal and CondenseSFTModule.export_manifest == CONDENSE_FILE
    assert (MoELightningModule.trains_dense_models, MoELightningModule.expert_parallel_refusal,
            MoELightningModule.export_manifest) == (False, None, None)
    gone = OmegaConf.create({"_target_": "moe_lab.methods.gone.Module"})  # a run written by another version
    assert module_fact(gone, "export_manifest", "default") == "default"
    with pytest.raises(ValueError, match=r"method._target_ is missing"):
        module_class(OmegaConf.create({"name": "kd"}))


def test_an_option_of_the_wrong_type_is_refused_by_its_installer_annotation():
    """The installer's signature types its options: a float takes a whole number, ``| None`` takes None, and a
    value of another type is refused naming the option (YAML's ``1e-3`` without a dot is text)."""
    from moe_lab.methods.registry import check_option_types

    condenser = METHODS["condenser"].install
    check_option_types("condenser", condenser, {"gamma": 1, "n": 0, "center": True, "bias_file": None,
                                                "experts": {0: [1]}, "select": "lowest_bias"})
    for option, value, expected in [("gamma", "1e-3", "float"), ("n", 2.0, "int"), ("center", 1, "bool"),
                                    ("n", True, "int"), ("experts", [1, 2], "dict or None")]:
        with pytest.raises(ValueError, match=re.escape(f"method.options.{option}={value!r} must be {expected} (an "
                                                       "option of method 'condenser')")):
            check_option_types("condenser", condenser, {option: value})
