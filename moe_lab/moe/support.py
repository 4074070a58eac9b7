"""Which methods are defined for which routing or expert layout: the one place an installer asks before it
refuses, and that the support matrix (``python -m moe_lab.families --markdown``) reads.

A method not named in :data:`UNDEFINED` works on every family's uniform view.
"""

from __future__ import annotations

from collections.abc import Callable

from .registry import NO_DENSE_TARGET, FamilySpec
from .routing import RoutingRule


def _sparsemixer(reason: str) -> Callable[[FamilySpec, RoutingRule], str | None]:
    return lambda spec, rule: reason if rule.score == "sparsemixer" else None


def _gate_up_only(spec: FamilySpec, rule: RoutingRule) -> str | None:
    if spec.expert_layout not in ("gate_up", "w1_v1_w2"):
        return "condensed layers support the gate_up and w1_v1_w2 expert layouts only (GPT-OSS's clamped GLU with " \
               "biases is not implemented)"
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


# method -> check(spec, rule): the reason the method is undefined for that family, or None
UNDEFINED: dict[str, Callable[[FamilySpec, RoutingRule], str | None]] = {
    "densemixer": _sparsemixer("sparsemixer routing already has its own router-gradient estimator (Heun's "
                               "third-order); use method=sft"),
    "condenser": _sparsemixer("selection biases and forced experts are not defined for sparsemixer routing"),
    "condense": _gate_up_only,
    "to_dense": _dense_target,
}


def undefined_reason(method: str, spec: FamilySpec, rule: RoutingRule) -> str | None:
    """Why ``method`` is not defined for the family of ``spec`` (with routing ``rule``); None when it is."""
    check = UNDEFINED.get(method)
    return None if check is None else check(spec, rule)


def refuse_undefined(method: str, spec: FamilySpec, rule: RoutingRule) -> None:
    """Raise a ValueError naming ``method``, the family and the reason when the method is undefined for it."""
    reason = undefined_reason(method, spec, rule)
    if reason is not None:
        raise ValueError(f"{method} is not defined for {spec.model_type}: {reason}")
