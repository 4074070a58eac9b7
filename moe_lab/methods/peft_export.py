"""moe-lab's LoRA adapters in PEFT's format: ``<export>/adapter/`` (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained(vanilla_base, <export>/adapter)`` loads.

* ``nn.Linear`` targets (attention, shared experts, dense MLPs) are PEFT ``target_modules``: the same math
  (``W x + (alpha / r) B A x``), the same ``lora_A`` [r, in] / ``lora_B`` [out, r] tensors. PEFT rewrites
  target modules named like transformers-v4 experts (``gate_proj``, ``up_proj``, ``down_proj`` on OLMoE,
  Qwen3-MoE, DeepSeek-V2/V3; ``w1``-``w3`` on Mixtral) into v5 expert parameters when it loads a v5 model, so
  such linear modules (a dense MLP, shared experts) are targeted as the parameter ``<module>.weight`` instead
  (PEFT ``target_parameters``, ``W + (alpha / r) B A``: the same adapter, merged into the weight).
* Packed expert tensors (3-D ``gate_up_proj`` / ``down_proj``) are PEFT ``target_parameters`` (peft >= 0.17,
  ``ParamWrapper``): ``W_e + (alpha / r) B_e A_e`` per expert, as moe-lab's :class:`~.lora.PackedLoRA`. PEFT
  keeps the E experts' factors in one ``lora_A`` [r E, in] / ``lora_B`` [out, r E] pair; the tensors below
  are moe-lab's rearranged to PEFT's layout (also for GPT-OSS's ``is_transposed`` [E, in, out] experts).
* A router the method trains full rank (``sft``, ``densemixer`` + LoRA) is saved whole as a PEFT
  ``modules_to_save`` module; a frozen one is the base model's and is not saved.
* Every tensor is in the model's load dtype, as in the merged export (fp32 master weights cast once).

What PEFT cannot express is not in the adapter (parameters a method adds, e.g. Compressed Experts'
vectors, or Expert Condenser's router biases): those runs load from the merged export itself.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from ..core.precision import in_load_dtype
from .lora import ADAPTER_EXPORTS, LinearLoRA, PackedLoRA

ADAPTER_DIR = "adapter"
log = logging.getLogger(__name__)
_PREFIX = "base_model.model."


def _lora_parts(patch):
    """``({linear module name: LinearLoRA}, {"<module>.<param>": PackedLoRA}, [trained router module names])``."""
    linear, packed = {}, {}
    for name, module in patch.model.named_modules():
        if isinstance(getattr(module, "lora", None), LinearLoRA):
            linear[name] = module.lora
        for pname, plist in getattr(module, "parametrizations", {}).items():
            for p in plist:
                if isinstance(p, PackedLoRA):
                    packed[f"{name}.{pname}"] = p
    names = {id(m): n for n, m in patch.model.named_modules()}
    routers = [names[id(view.router)] for view in patch.views
               if any(p.requires_grad for p in view.router.parameters())]
    return linear, packed, routers


def _rank_alpha(adapters) -> tuple[int, float]:
    ranks = {int(a.lora_A.shape[-2]) for a in adapters}
    scales = {float(a.scale) for a in adapters}
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError(f"LoRA adapters of different ranks {sorted(ranks)} / scales {sorted(scales)}: PEFT's "
                         "LoraConfig holds one rank and alpha")
    (rank,), (scale,) = ranks, scales
    return rank, scale * rank


def peft_config(patch, as_parameters: frozenset[str] = frozenset()):
    """The :class:`peft.LoraConfig` describing ``patch``'s adapters (module and parameter names of the vanilla
    model); linear modules named in ``as_parameters`` are targeted through their ``weight`` parameter."""
    from peft import LoraConfig

    linear, packed, routers = _lora_parts(patch)
    if not linear and not packed:
        raise ValueError("no LoRA adapters on this model: the PEFT export needs method.lora")
    rows = [name for name in packed if patch.model.get_parameter(f"{name.rsplit('.', 1)[0]}.parametrizations."
                                                                 f"{name.rsplit('.', 1)[1]}.original").dim() != 3]
    if rows:
        raise ValueError(f"{rows[0]} stores its experts as row blocks of a 2-D tensor (DBRX's [E*I, H]): PEFT's "
                         "target_parameters give such a tensor ONE LoRA pair, not one per expert; load the merged "
                         "export instead")
    rank, alpha = _rank_alpha([*linear.values(), *packed.values()])
    dropout = [float(a.dropout.p) for a in linear.values() if isinstance(a.dropout, nn.Dropout)]
    parameters = sorted([*packed, *(f"{name}.weight" for name in as_parameters)])
    return LoraConfig(  # PEFT's parameter targets take no dropout: 0 there (the same model at inference)
        r=rank, lora_alpha=alpha, lora_dropout=(dropout[0] if dropout and not parameters else 0.0),
        target_modules=sorted(set(linear) - as_parameters) or None, target_parameters=parameters or None,
        modules_to_save=routers or None, bias="none", task_type="CAUSAL_LM",
        base_model_name_or_path=getattr(patch.model, "name_or_path", None) or None,
    )


def _packed_factors(lora, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """moe-lab's per-expert ``B_e [m, r] @ A_e [r, n]`` as PEFT's ``lora_A.weight`` / ``lora_B.weight``.

    PEFT reshapes ``lora_A.weight`` to [E, r, in] and ``lora_B.weight`` to [out, r, E]; for [E, out, in]
    experts (``in`` = n) ``delta[e] = B[:, :, e] @ A[e]``, for ``is_transposed`` [E, in, out] ones
    (``in`` = m) ``delta[e] = (B[:, :, e] @ A[e]).T``, so A and B swap roles there.
    """
    a, b = lora.lora_A.detach(), lora.lora_B.detach()  # [E, r, n], [E, m, r]
    experts, rank = a.shape[0], a.shape[1]
    if not transposed:
        return a.reshape(experts * rank, -1), b.permute(1, 2, 0).reshape(b.shape[1], rank * experts)
    return b.transpose(1, 2).reshape(experts * rank, -1), a.permute(2, 1, 0).reshape(a.shape[2], rank * experts)


def peft_state_dict(patch, as_parameters: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Adapter tensors keyed ``base_model.model.<module>[.<parameter>].lora_{A,B}.weight`` (and the trained
    routers' tensors); :func:`save_peft_adapter` renames them to the keys PEFT itself saves."""
    linear, packed, routers = _lora_parts(patch)
    state = {}
    for name, lora in linear.items():
        target = f"{name}.weight" if name in as_parameters else name
        state[f"{_PREFIX}{target}.lora_A.weight"] = lora.lora_A.detach()
        state[f"{_PREFIX}{target}.lora_B.weight"] = lora.lora_B.detach()
    for name, lora in packed.items():
        owner = patch.model.get_submodule(name.rsplit(".", 1)[0])
        state[f"{_PREFIX}{name}.lora_A.weight"], state[f"{_PREFIX}{name}.lora_B.weight"] = _packed_factors(
            lora, bool(getattr(owner, "is_transposed", False)))
    for name in routers:
        for key, value in patch.model.get_submodule(name).state_dict().items():
            state[f"{_PREFIX}{name}.{key}"] = value.detach()
    return state


def _peft_keys(config, model_config) -> tuple[dict[str, str], set[str], set[str]]:
    """Build the PEFT model of ``config`` on the meta device, as ``PeftModel.from_pretrained`` would: map our
    ``<module>[.<param>].lora_X.weight`` keys to the keys PEFT saves (it nests the wrappers of several
    parameters of one module: ``experts.base_layer.lora_A.weight``); also return the keys PEFT saves and the
    ``target_modules`` that got no adapter (rewritten by PEFT's v4 -> v5 conversion)."""
    import copy

    import transformers
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer
    from peft.utils import get_peft_model_state_dict

    with torch.device("meta"):
        vanilla = transformers.AutoModelForCausalLM.from_config(model_config)
    model = get_peft_model(vanilla, copy.deepcopy(config))  # PEFT converts the config in place
    saved = set(get_peft_model_state_dict(model))
    mapping, wrapped = {}, set()
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = name.replace(".base_layer", "")
        param = getattr(module, "parameter_name", None)
        ours = f"{base}.{param}" if param else base
        wrapped.add(base.removeprefix(_PREFIX))
        for part in ("lora_A", "lora_B"):
            if f"{name}.{part}.weight" in saved:
                mapping[f"{ours}.{part}.weight"] = f"{name}.{part}.weight"
    return mapping, saved, set(config.target_modules or ()) - wrapped


def config_parameters(config) -> frozenset[str]:
    """Linear modules a config targets through their ``.weight`` parameter."""
    return frozenset(t.removesuffix(".weight") for t in config.target_parameters or () if t.endswith(".weight"))


def save_peft_adapter(patch, export_dir: str | Path) -> Path:
    """Write ``<export_dir>/adapter/`` in PEFT's format (an export hook of ``method.lora`` runs)."""
    from safetensors.torch import save_file

    config = peft_config(patch)
    keys, saved, lost = _peft_keys(config, patch.model.config)
    if lost:
        config = peft_config(patch, as_parameters=frozenset(lost))
        keys, saved, lost = _peft_keys(config, patch.model.config)
    state = in_load_dtype(patch.model, peft_state_dict(patch, config_parameters(config)))  # as the merged export
    state = {keys.get(k, k): v.contiguous().clone() for k, v in state.items()}
    if set(state) != saved:
        raise RuntimeError(f"PEFT adapter keys do not match PEFT's own: missing {sorted(saved - set(state))[:4]}, "
                           f"unexpected {sorted(set(state) - saved)[:4]}")
    out = Path(export_dir) / ADAPTER_DIR
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(state, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "README.md").write_text(
        "LoRA adapter of a moe-lab run in PEFT's format: `peft.PeftModel.from_pretrained(base, this_dir)` on the\n"
        f"vanilla base model. Config: {json.dumps({'r': config.r, 'lora_alpha': config.lora_alpha})}.\n")
    return out


def export_hook(patch, export_dir: str | Path) -> Path | None:
    """:func:`save_peft_adapter` as an export hook: a failure is a warning, the merged export is still written."""
    try:
        return save_peft_adapter(patch, export_dir)
    except Exception as error:  # noqa: BLE001 - the merged checkpoint is the primary export
        log.warning("LoRA: no PEFT adapter written beside the export (%s: %s)", type(error).__name__, error)
        return None


ADAPTER_EXPORTS.append(export_hook)  # every LoRA patch writes <export>/adapter/ beside its merged export
