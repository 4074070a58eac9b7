"""Where an operation is undefined for a routing or expert layout: the rules (:func:`sparsemixer_only`,
:func:`output_weighted`, :func:`first_reason`) a method's registration builds its ``undefined_for`` from
(:class:`moe_lab.methods.registry.MethodSpec`), and the layer-level operations' own rules (:data:`UNDEFINED`:
condensing, to_dense, the calibration scores that read the routing weight), which the compression code asks before
it refuses. The support matrix (``python -m moe_lab.families --markdown``) prints both.
"""

from __future__ import annotations

from collections.abc import Callable

from .layout import LAYOUTS
from .registry import NO_DENSE_TARGET, FamilySpec
from .routing import RoutingRule


def sparsemixer_only(reason: str) -> Callable[[FamilySpec, RoutingRule], str | None]:
    """``reason`` for families whose router is sparsemixer (its own router-gradient estimator)."""
    return lambda spec, rule: reason if rule.score == "sparsemixer" else None


def first_reason(*checks: Callable[[FamilySpec, RoutingRule], str | None]) -> Callable[[FamilySpec, RoutingRule], str | None]:
    """The first reason any of ``checks`` gives (None when none does)."""
    return lambda spec, rule: next((r for r in (check(spec, rule) for check in checks) if r is not None), None)


def output_weighted(reason: str) -> Callable[[FamilySpec, RoutingRule], str | None]:
    """``reason`` for families whose routing weight scales the expert input (registry ``weight_on_input``)."""
    return lambda spec, rule: f"{reason}; here the routing weight scales the expert input, y = sum_e E_e(w_e x)" \
        if spec.weight_on_input else None


def _condensable(spec: FamilySpec, rule: RoutingRule) -> str | None:
    if spec.weight_on_input:
        return "condensed layers are shared + sum_e g_e E_e(x), fixed gates on the expert outputs; here the routing " \
               "weight scales the expert input, y = sum_e E_e(w_e x), which a fixed output gate does not reproduce"
    if LAYOUTS[spec.expert_layout].biases:
        return "condensed layers compute act(gate) * up on the layout's role views, without expert biases (GPT-OSS's " \
               "clamped GLU with biases is not implemented)"
    if spec.expert_act != "act_fn":
        return "condensed layers compute act(gate) * up; these experts use their own clamped gate (_apply_gate)"
    if spec.output_scaling_field:
        return f"condensed layers do not apply the block's output scaling ({spec.output_scaling_field})"
    if spec.shared_combine_field:
        return f"condensed layers sum the shared path; this block may average it ({spec.shared_combine_field})"
    if spec.output_norm_attr:
        return f"condensed layers do not apply the block's output norm ({spec.output_norm_attr})"
    return None


def _dense_target(spec: FamilySpec, rule: RoutingRule) -> str | None:
    if spec.dense_target is None:
        return NO_DENSE_TARGET.get(spec.model_type, "no vanilla dense HF target (registry dense_target is None)")
    return None


# operation -> check(spec, rule): the reason it is undefined for that family, or None (a method's own rule is
# in its registration)
UNDEFINED: dict[str, Callable[[FamilySpec, RoutingRule], str | None]] = {
    "condense": _condensable,
    # calibration scores read from the router-weighted output norm w_e ||f_e(x)|| (f_e unweighted)
    "reap": output_weighted("REAP scores an expert by its router-weighted output norm w_e norm(E_e(x)), the size of "
                             "its contribution to sum_e w_e E_e(x); use another score (e.g. ean_mean, es_act)"),
    "es_mag": output_weighted("gated ES-Mag scores an expert by norm(w_e E_e(x)), its contribution to sum_e w_e E_e(x); "
                               "use es_mag variant=ungated"),
    "to_dense": _dense_target,
}


Check = Callable[[FamilySpec, RoutingRule], str | None]


def undefined_reason(method: str, spec: FamilySpec, rule: RoutingRule, check: Check | None = None) -> str | None:
    """Why ``method`` is not defined for the family of ``spec`` (with routing ``rule``); None when it is.
    ``check``: the method's own rule (a method's registration), else :data:`UNDEFINED`'s."""
    check = check or UNDEFINED.get(method)
    return None if check is None else check(spec, rule)


def refuse_undefined(method: str, spec: FamilySpec, rule: RoutingRule, check: Check | None = None) -> None:
    """Raise a ValueError naming ``method``, the family and the reason when the method is undefined for it."""
    reason = undefined_reason(method, spec, rule, check)
    if reason is not None:
        raise ValueError(f"{method} is not defined for {spec.model_type}: {reason}")
