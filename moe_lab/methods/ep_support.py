"""Which built methods run under expert parallelism (``hardware.ep_size > 1``): a method whose registration says
``expert_parallel=True`` (its experts are the HF experts call EP dispatches), without the choices that act inside
the experts, and whose LightningModule states no ``expert_parallel_refusal``; everything else is refused by name
before the first step."""

from __future__ import annotations

from .registry import METHODS, NOT_PROVEN_UNDER_EP, expert_parallel_methods


def check_method(module, ep_size: int) -> None:
    """Refuse, by name, a method (its installer), LoRA on experts or fp32 masters in the optimizer that cannot run
    under ``hardware.ep_size > 1`` (plan and run call it through :func:`moe_lab.runs.checks.refuse_before_first_step`)."""
    if ep_size <= 1:
        return
    hparams = getattr(module, "hparams", {})
    name = hparams.get("name") or getattr(module, "method", None)
    installer = getattr(module, "method", None)
    where = f"method={name} under hardware.ep_size={ep_size}"
    runs = ("the methods that run under EP: " + ", ".join(expert_parallel_methods())
            + " (and their variants, e.g. sft_aux_free)")
    refusal = getattr(type(module), "expert_parallel_refusal", None)
    if refusal:
        raise ValueError(f"{where}: {refusal}. Use hardware.ep_size=1 (DDP, ZeRO or FSDP); {runs}")
    if installer not in METHODS or not METHODS[installer].expert_parallel:
        raise ValueError(f"{where}: {NOT_PROVEN_UNDER_EP}; {runs}")
    patch = getattr(module, "patch", None)
    if patch is not None and any(k.endswith((".lora0", ".lora1")) for k in patch.expert_slice_masks):
        raise ValueError(f"{where}: LoRA on ESFT's selected experts masks the adapters' gradients by hooks that EP "
                         "does not move to the sharded adapters; drop 'experts' from method.lora.targets or use "
                         "hardware.ep_size=1")
    if patch is not None and any(getattr(getattr(block, "compressed_experts", None), "up_input_scale", None)
                                 is not None for block in patch.layers):
        raise ValueError(f"{where}: compressed_experts' form=gate_up_intermediate scales the gate and up inputs and "
                         "the intermediate activation apart, inside the experts, which the dispatched experts call "
                         "does not take; use method.options.form=input (the paper's section 2.2) or "
                         "hardware.ep_size=1")
    if getattr(module, "master_weights", None) == "optimizer":
        raise ValueError(f"{where}: method.master_weights=optimizer steps fp32 copies the EP gradient reduction and "
                         "clipping do not see; use method.master_weights=fp32")
