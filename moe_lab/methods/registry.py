"""The method registry: ``moe_lab.apply(model, method, **options)``, and everything moe-lab knows about a method.

A method is one unit: its module registers its installer with :func:`register_method`, and that one registration
carries its facts (:class:`MethodSpec`): where it is undefined, whether it runs under expert parallelism, the
strategies it cannot train under, its cost row, the lines ``plan=true`` prints for it and the expert pass it
computes itself. The support matrix, the EP and kernel refusals, the memory estimate and the plan read them
here; ``moe_lab.methods`` imports every module of its package, so a new method's module is found without a list.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..core.registration import register_once
from ..moe.block import MoEBlock
from ..moe.experts_backend import check_name
from ..moe.patch import MoEPatch
from ..moe.support import refuse_undefined
from ..moe.support import undefined_reason as _layer_undefined_reason

#: what a method that does not say otherwise is, under ``hardware.ep_size > 1``
NOT_PROVEN_UNDER_EP = "not proven under expert parallelism"


@dataclass(frozen=True)
class MethodSpec:
    """One method's registration.

    - ``install(patch, **options)``: the installer ``apply`` calls (its keyword defaults are the method's option
      defaults: conf/method/<name>.yaml holds the same values, tests/methods/test_option_defaults.py pins them);
    - ``undefined_for(family_spec, rule)``: why the method is not defined for a family (None: it is), built from
      :mod:`moe_lab.moe.support`'s rules; the installer refuses with it and the support matrix prints it;
    - ``expert_parallel``: its expert computation is the HF experts call, which EP dispatches (proven by the EP
      tests); False: refused under ``hardware.ep_size > 1``;
    - ``refused_strategies``: the memory estimate's strategies it cannot train under (left out of plan's options);
    - ``cost_row``: the row of :mod:`moe_lab.analysis.estimate` that prices a run of it, or ``cost_row(cfg)``
      choosing it (None: ``"sft"``); the row is registered by the method's module with ``register_cost_row``;
    - ``plan_lines(cfg, length)``: the lines ``plan=true`` prints for its own phases (``length``: the run's step
      counts, or None);
    - ``own_experts_pass``: its training pass computes the routed experts itself with grouped GEMMs (named here),
      so another experts kernel would not be used (refused: ``model.experts_implementation``).
    """

    name: str
    install: Callable
    undefined_for: Callable | None = None
    expert_parallel: bool = False
    refused_strategies: tuple[str, ...] = ()
    cost_row: str | Callable | None = None
    plan_lines: Callable | None = None
    own_experts_pass: str | None = None

    def undefined_reason(self, spec, rule) -> str | None:
        """Why this method is not defined for the family of ``spec`` (routing ``rule``); None when it is."""
        return None if self.undefined_for is None else self.undefined_for(spec, rule)

    def refuse_undefined(self, spec, rule) -> None:
        """Raise a ValueError naming the method, the family and the reason when it is undefined for it."""
        if self.undefined_for is not None:
            refuse_undefined(self.name, spec, rule, self.undefined_for)


#: method name -> its registration; each method module registers its own (:func:`register_method`) and
#: ``moe_lab.methods`` imports them all, so the registry imports none of them
METHODS: dict[str, MethodSpec] = {}
#: adapter name -> ``(patch, base_parameters, **options)`` added on top of any method (``apply(lora={...})``)
ADAPTERS: dict[str, Callable] = {}


def register_method(name: str, **facts) -> Callable[[Callable], Callable]:
    """``@register_method("sft", **facts)`` on an installer: ``apply(model, "sft", **options)`` calls it; ``facts``
    are the other fields of its :class:`MethodSpec`."""
    return register_once(METHODS, name, "method", lambda install: MethodSpec(name, install, **facts))


def method_of(cfg) -> MethodSpec | None:
    """The registration of a run config's installer (``cfg.method.method``, else ``cfg.method.name``); None for a
    method without one (kd, condense_sft)."""
    return METHODS.get(str(cfg.method.get("method") or cfg.method.get("name")))


def method_spec(name: str) -> MethodSpec:
    """The registration of installer ``name`` (``cfg.method.method``); a ValueError naming the choices otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}: choose one of {', '.join(supported_methods())}")
    return METHODS[name]


def undefined_reason(name: str, spec, rule) -> str | None:
    """Why method ``name`` (or a layer-level operation of :mod:`moe_lab.moe.support`: condense, to_dense, a
    calibration score) is not defined for the family of ``spec``; None when it is."""
    if name in METHODS:
        return METHODS[name].undefined_reason(spec, rule)
    return _layer_undefined_reason(name, spec, rule)


def refuse_method_backend(method: str | None, kernel: str | None) -> None:
    """Refuse an unknown experts kernel, and a method whose training pass computes the experts itself
    (``own_experts_pass``) on a kernel it would not use (plan and run:
    :func:`moe_lab.runs.checks.refuse_before_first_step`)."""
    check_name(kernel)
    own = METHODS[method].own_experts_pass if method in METHODS else None
    if kernel in (None, "grouped_mm") or own is None:
        return
    raise ValueError(f"model.experts_implementation={kernel} with method {method}: {own} computes the routed experts "
                     "itself with grouped GEMMs (the grouped_mm arithmetic), so the kernel would not be used in "
                     "training; set model.experts_implementation=grouped_mm (or null)")


def expert_parallel_methods() -> list[str]:
    """The installers that run under ``hardware.ep_size > 1``, in registration order."""
    return [name for name, spec in METHODS.items() if spec.expert_parallel]


def register_adapter(name: str) -> Callable[[Callable], Callable]:
    """``@register_adapter("lora")`` on an adapter: ``apply(model, method, lora={...})`` adds it."""
    return register_once(ADAPTERS, name, "adapter")


def register_export_loader(filename: str) -> Callable[[Callable], Callable]:
    """``@register_export_loader(STATE_FILE)`` on a loader ``(model, directory) -> MoEPatch``: an export
    holding ``filename`` gets its method re-installed by :func:`install_exported_routing`."""
    return register_once(EXPORT_LOADERS, filename, "export loader")


# files a method writes beside an export -> the loader that re-installs that method on the vanilla model
EXPORT_LOADERS: dict[str, Callable] = {}  # filled by register_export_loader


def install_exported_routing(model: nn.Module, directory: str | Path) -> MoEPatch | None:
    """Re-install the moe-lab routing an export carries beside its vanilla weights (vanilla HF cannot express
    it); returns the patch, or None for an export with plain HF routing."""
    for filename, load in EXPORT_LOADERS.items():
        if (Path(directory) / filename).is_file():
            return load(model, directory)
    return None


#: an installer annotation -> what it accepts (a float also takes a whole number; bool is not a number)
_ACCEPTS = {bool: lambda v: isinstance(v, bool), int: lambda v: isinstance(v, int) and not isinstance(v, bool),
            float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), str: lambda v: isinstance(v, str),
            dict: lambda v: isinstance(v, Mapping), Mapping: lambda v: isinstance(v, Mapping)}


def check_option_types(method: str, installer: Callable, options: dict) -> None:
    """Refuse an option whose value is not of the type its installer parameter is annotated with (``int``,
    ``float``, ``bool``, ``str``, a mapping, or one of them ``| None``), naming the option and the type: the
    installer's signature is the one place of each option's type and default."""
    hints = typing.get_type_hints(installer)
    for name, value in options.items():
        hint = hints.get(name)
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if value is None and type(None) in kinds:
            continue
        checks = [_ACCEPTS[k] for k in kinds if k in _ACCEPTS]
        if not checks or len(checks) != len([k for k in kinds if k is not type(None)]):
            continue  # an annotation this check does not read: the installer checks the value itself
        if not any(check(value) for check in checks):
            expected = " or ".join("None" if k is type(None) else getattr(k, "__name__", str(k)) for k in kinds)
            text_number = isinstance(value, str) and (int in kinds or float in kinds)
            raise ValueError(f"method.options.{name}={value!r} must be {expected} (an option of method {method!r})"
                             + ("; YAML reads 1e-3 as text: write 1.0e-3" if text_number else ""))


def supported_methods() -> list[str]:
    """Names accepted by :func:`apply`."""
    return sorted(METHODS)


def apply(model: nn.Module, method: str = "sft", lora: dict | None = None, **options) -> MoEPatch:
    """Install moe-lab MoE blocks into a loaded HF MoE model in place and set up ``method``.

    ``lora`` (rank, alpha, dropout, targets, train_router; see :mod:`moe_lab.methods.lora`) adds
    adapters on top of any method. Returns the :class:`MoEPatch` (``.layers``, ``.export()``, ``.remove()``).
    """
    installer = method_spec(method).install
    if any(isinstance(m, MoEBlock) for m in model.modules()):
        raise ValueError("this model already has moe-lab blocks installed: call patch.remove() first")
    accepted = set(inspect.signature(installer).parameters) - {"patch"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"method {method!r} got unknown option(s) {unknown}; it accepts {sorted(accepted) or 'none'}"
        )
    check_option_types(method, installer, options)
    base_parameters = {id(p) for p in model.parameters()}
    patch = MoEPatch(model, method=method)
    installer(patch, **options)
    if lora:
        add_lora = ADAPTERS["lora"]
        accepted = set(inspect.signature(add_lora).parameters) - {"patch", "base_parameters"}
        bad = sorted(set(lora) - accepted)
        if bad:
            raise TypeError(f"lora got unknown option(s) {bad}; it accepts {sorted(accepted)}")
        add_lora(patch, base_parameters, **lora)
    return patch
