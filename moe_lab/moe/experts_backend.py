"""``model.experts_implementation``: which of transformers' experts kernels the packed routed experts run on.

transformers (5.24) dispatches every packed experts module's forward on ``config._experts_implementation``:
``eager`` (a loop over the hit experts), ``batched_mm`` (the expert weights gathered per (token, slot) pair, one
bmm), ``grouped_mm`` (the pairs sorted by expert, one grouped GEMM per projection; transformers' default where a
family supports choosing), and the GPU kernels ``sonicmoe`` and ``deepgemm``. ``null`` keeps transformers'
choice. moe-lab's blocks call the experts module itself, so sft, frozen_router, the condenser methods, LoRA and
DenseMixer's forward follow the chosen kernel and stay bit-identical to vanilla HF on it
(tests/moe/test_experts_backends.py). Two methods run their own grouped-GEMM experts pass in training (ESFT's
trained-slices pass, Compressed Experts' scaled pass): they are refused on any kernel but ``grouped_mm`` /
``null``, naming the fix (their registration's ``own_experts_pass``, :func:`moe_lab.methods.registry.refuse_method_backend`). DenseMixer's inactive-expert pass (router gradient only)
is grouped GEMMs on every kernel.
"""

from __future__ import annotations

BACKENDS = ("eager", "batched_mm", "grouped_mm", "sonicmoe", "deepgemm")


def gpu_kernel_problem(name: str) -> str | None:
    """Why the GPU kernel ``name`` cannot load here (transformers' own check), None if it can."""
    if name == "sonicmoe":
        from transformers.integrations.sonicmoe import is_sonicmoe_loadable as loadable
    elif name == "deepgemm":
        from transformers.integrations.deepgemm import is_deepgemm_loadable as loadable
    else:
        return None
    try:
        loadable(raise_error=True)
    except (ImportError, RuntimeError) as err:
        return str(err).splitlines()[0]
    return None


def set_experts_implementation(model, name: str | None) -> None:
    """Run ``model``'s packed experts on transformers' kernel ``name`` (None: leave transformers' choice), or refuse
    with the field and the fix: an unknown name, a GPU kernel that cannot load here, a family whose experts have
    one implementation."""
    if name is None:
        return
    field = f"model.experts_implementation={name}"
    check_name(name)
    problem = gpu_kernel_problem(name)
    if problem:
        raise ValueError(f"{field}: {problem} Use grouped_mm (or null) on this machine")
    try:
        model.set_experts_implementation(name)
    except (ValueError, RuntimeError) as err:
        raise ValueError(f"{field}: {type(model).__name__}: {str(err).splitlines()[0]} Set "
                         "model.experts_implementation=null") from None
    if model.config._experts_implementation != name:  # transformers keeps a family's only implementation silently
        raise ValueError(f"{field}: {type(model).__name__}'s experts have one implementation "
                         f"({model.config._experts_implementation}); set model.experts_implementation=null")


def check_name(name: str | None) -> None:
    """Refuse a kernel name transformers does not have."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"model.experts_implementation={name}: choose one of {', '.join(BACKENDS)}, or null "
                         "(transformers' default)")
