"""LoRA adapters as an option of every method: ``moe_lab.apply(model, method, lora={...})``.

Packed expert tensors ([E, d_out, d_in], or GPT-OSS's [E, d_in, d_out]) get one low-rank pair per
expert through a weight parametrization ``W_e + (alpha / rank) * B_e @ A_e`` (so every mixer, including
DenseMixer's and ESFT's slices, sees the adapted experts). With ``experts="split"`` (the default) the
conventional mixture and DenseMixer's inactive-expert pass never evaluate it: they run ``x W + scale (x A) B``
on the routed rows (:func:`moe_lab.moe.experts.split_lora_mixture`); ``merged`` evaluates it once per forward. ``nn.Linear`` targets (attention, shared
experts, dense MLPs) get the usual activation-space adapter ``W x + (alpha / rank) * B A dropout(x)``.
Input dropout cannot be factored out of a weight parametrization, so ``dropout > 0`` is applied to the
linear targets only (and rejected when only packed experts are targeted). B starts at zero, so the
adapted model equals the base model at step 0.

As in the DenseMixer paper, adapters go on every linear module except the router (default targets: all
of :data:`TARGETS`); a target list naming the router is refused. Base weights are frozen, except the
router: it keeps the trainability the method gave it and trains full rank beside the adapters
("Conventional + LoRA": ``sft``; "DenseMixer + LoRA": ``densemixer``, with its straight-through gradient)
or stays frozen ("Frozen Router + LoRA": ``frozen_router``; ESFT). Linear targets whose base weight the
method freezes (e.g. ESFT's attention) get no adapter. Parameters a method adds (e.g. Compressed Experts'
vectors) keep training. :func:`merged_state_dict` gives the merged weights for export.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..analysis.estimate import CostContext, register_cost_row
from ..analysis.meta_costs import moe_views
from ..core.precision import export_in_load_dtype
from ..moe.block import SliceGradMask
from ..moe.layout import expert_mask
from ..moe.patch import MoEPatch
from .registry import register_adapter

TARGETS = ("experts", "shared_experts", "attention", "dense_mlp")
# linear targets -> the MoEPatch.parameter_groups() group whose nn.Linear modules get adapters
_LINEAR_TARGET_GROUPS = {"attention": "attention", "shared_experts": "shared_experts", "dense_mlp": "other"}
#: export hooks ``(patch, export_dir)`` every LoRA patch gets: writers of the adapters beside the merged
#: export. :mod:`moe_lab.methods.peft_export` adds its ``<export>/adapter/`` (PEFT) writer (``moe_lab.methods``
#: imports it)
ADAPTER_EXPORTS: list = []


class PackedLoRA(nn.Module):
    """Parametrization of an expert tensor seen as [E, m, n] (packed, or DBRX's [E*m, n] rows, whose [E, m, n]
    view it takes): ``W + scale * B @ A`` with B [E, m, r] = 0."""

    def __init__(self, shape: torch.Size, rank: int, scale: float, dtype, device):
        super().__init__()
        experts, m, n = shape
        self.scale = scale
        self.lora_A = nn.Parameter(torch.empty(experts, rank, n, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(experts, m, rank, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lora_A.view(-1, n), a=math.sqrt(5))

    def delta(self) -> torch.Tensor:
        """``scale * B @ A`` [E, m, n]."""
        return self.scale * torch.bmm(self.lora_B, self.lora_A)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta().view(weight.shape)


class LinearLoRA(nn.Module):
    """Adapter of one ``nn.Linear``, added to its output by a forward hook."""

    def __init__(self, linear: nn.Linear, rank: int, scale: float, dropout: float):
        super().__init__()
        w = linear.weight
        self.scale = scale
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.lora_A = nn.Parameter(torch.empty(rank, w.shape[1], dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(w.shape[0], rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def delta(self) -> torch.Tensor:
        return self.scale * self.lora_B @ self.lora_A

    def hook(self, module, args, output):
        x = self.dropout(args[0])
        return output + self.scale * ((x @ self.lora_A.t()) @ self.lora_B.t())


@register_adapter("lora")
def add_lora(
    patch: MoEPatch,
    base_parameters: set[int],
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    targets: list[str] | tuple[str, ...] = TARGETS,
    train_router=None,
    experts: str = "split",
) -> None:
    """Freeze the base weights (ids in ``base_parameters``) except the router, and attach adapters to
    ``targets``. The router keeps the trainability the method gave it (full rank). ``experts``: how the
    conventional mixture runs adapted packed experts, ``split`` (x A B on the routed rows, no per-expert delta)
    or ``merged`` (the weights ``W + scale B A``, materialised once per forward)."""
    targets = list(targets)
    if experts not in ("split", "merged"):
        raise ValueError(f"method.lora.experts={experts}: choose split (x A B on the routed rows) or merged "
                         "(W + scale B A per forward)")
    if train_router is not None:
        raise ValueError("method.lora.train_router is gone: the method decides whether the router trains (full "
                         "rank): method=sft / densemixer train it, method=frozen_router freezes it")
    if any("router" in str(t) or str(t) == "gate" for t in targets):
        raise ValueError(f"method.lora.targets={targets} names the router: LoRA goes on every linear module except "
                         "the router (DenseMixer paper), which trains full rank or stays frozen as the method "
                         f"decides (method=frozen_router freezes it); choose from {', '.join(TARGETS)}")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"method.lora.targets={targets}: choose from {', '.join(TARGETS)}")
    if rank < 1:
        raise ValueError(f"method.lora.rank must be >= 1, got {rank}")
    if dropout and targets == ["experts"]:
        raise ValueError("method.lora.dropout > 0 cannot apply to packed experts (the input cannot be factored "
                         "out of a weight parametrization): set method.lora.dropout=0 or add linear targets")
    scale = alpha / rank
    router = {id(p) for view in patch.views for p in view.router.parameters()}
    linear = _linear_targets(patch, targets)
    method_trains = {id(m.weight) for m in linear if m.weight.requires_grad}
    for p in patch.model.parameters():
        if id(p) in base_parameters and id(p) not in router:
            p.requires_grad_(False)
    patch.lora_modules = []
    if "experts" in targets:
        for view, block in zip(patch.views, patch.layers):
            owner = view.expert_module  # the experts module, or DBRX's experts.mlp
            prefix = ".".join(filter(None, (view.name, "experts", view.layout.owner)))
            for name, tensor in view.expert_parameters().items():
                param = getattr(owner, name)
                if tensor.dim() != 3:
                    continue  # GPT-OSS expert biases stay frozen
                rows = next((m for q, m in patch.expert_slice_masks.values() if q is param), None)
                block.split_lora = experts == "split"
                lora = PackedLoRA(tensor.shape, rank, scale, param.dtype, param.device)
                parametrize.register_parametrization(owner, name, lora, unsafe=True)
                if rows is not None:  # ESFT: adapters only on the selected experts
                    mask = expert_mask(rows, view.num_experts)
                    for i, p in enumerate((lora.lora_A, lora.lora_B)):
                        p.register_hook(SliceGradMask(mask))
                        patch.expert_slice_masks[f"{prefix}.{name}.lora{i}"] = (p, mask)
    for module in linear:
        if id(module.weight) not in method_trains:
            continue  # the method freezes this weight (e.g. ESFT's attention): no adapter either
        lora = LinearLoRA(module, rank, scale, dropout)
        module.add_module("lora", lora)
        module.register_forward_hook(lora.hook)
        patch.lora_modules.append(module)
    # frozen base tensors no longer train any slice: only the adapters' masks remain
    patch.expert_slice_masks = {k: (p, m) for k, (p, m) in patch.expert_slice_masks.items() if p.requires_grad}
    patch.export_state_dict = functools.partial(merged_state_dict, patch)
    for export in ADAPTER_EXPORTS:
        patch.export_hooks.append(functools.partial(export, patch))  # <export>/adapter/ (PEFT)
    export_in_load_dtype(patch)  # merged in fp32 above, then every tensor cast once to the load dtype


def _linear_targets(patch: MoEPatch, targets: list[str]) -> list[nn.Linear]:
    """The ``nn.Linear`` modules whose weight lies in a targeted parameter group (the patch's one split of
    parameters into router, experts, shared_experts, attention, embeddings and other)."""
    groups = patch.parameter_groups()
    wanted = {id(p) for target in targets if target in _LINEAR_TARGET_GROUPS
              for _, p in groups[_LINEAR_TARGET_GROUPS[target]]}
    return [m for m in patch.model.modules() if isinstance(m, nn.Linear) and id(m.weight) in wanted]


def _packed_merge(module: nn.Module, name: str) -> torch.Tensor:
    """``W + scale * B @ A`` of a parametrized packed expert tensor, computed in fp32."""
    parametrization = module.parametrizations[name]
    if len(parametrization) != 1 or not isinstance(parametrization[0], PackedLoRA):
        return getattr(module, name).detach().float()
    lora = parametrization[0]
    a, b = lora.lora_A.detach().float(), lora.lora_B.detach().float()
    original = parametrization.original.detach().float()
    return original + (lora.scale * torch.bmm(b, a)).view(original.shape)


def merged_state_dict(patch: MoEPatch) -> dict[str, torch.Tensor]:
    """The HF model's state dict with every adapter merged into its base weight (vanilla key names). Merged
    tensors are fp32 (``W + scale * B @ A`` from fp32 copies); the export casts them once to the load dtype
    (:func:`~moe_lab.core.precision.export_in_load_dtype`)."""
    merged = {}
    for key, value in patch.model.state_dict().items():
        if ".lora." in key or "lora_A" in key or "lora_B" in key:
            continue
        if ".parametrizations." in key:
            owner, _, rest = key.partition(".parametrizations.")
            name = rest.split(".", 1)[0]
            if not rest.endswith(".original"):
                continue
            key, value = f"{owner}.{name}", _packed_merge(patch.model.get_submodule(owner), name)
        merged[key] = value.detach().clone()
    for module in getattr(patch, "lora_modules", []):
        name = next(n for n, m in patch.model.named_modules() if m is module)
        lora = module.lora
        delta = lora.scale * (lora.lora_B.detach().float() @ lora.lora_A.detach().float())
        merged[f"{name}.weight"] = module.weight.detach().float() + delta
    return merged


def _lora_linears(model) -> list[tuple[str, int, int]]:
    """(name, in, out) of every nn.Linear LoRA targets: all but routers and the lm_head (public DenseMixer
    setup)."""
    routers = {id(v.router) for v in moe_views(model)}
    out_emb = model.get_output_embeddings()
    return [(n, m.in_features, m.out_features) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m) not in routers and m is not out_emb]


@register_cost_row("lora", order=60)
def lora_costs(ctx: CostContext) -> dict:
    """The estimate's row: rank ``lora_rank`` adapters on every linear and expert projection, the router
    trained at full rank, the base weights frozen."""
    counts, r = ctx.counts, ctx.opts.lora_rank
    lin = _lora_linears(ctx.model)
    lora_dense = sum(2 * r * (i + o) for _, i, o in lin)
    lora_exp = sum(s.top_k * 2 * r * (3 * s.hidden + 3 * s.width) for s in counts.experts)
    lora_params = sum(r * (i + o) for _, i, o in lin) + sum(
        s.num_experts * r * (3 * s.hidden + 3 * s.width) for s in counts.experts) + counts.router
    return ctx.row(
        ctx.sft_f + lora_dense + lora_exp,
        ctx.b_frozen + ctx.experts(lambda s: s.top_k) + 2 * (lora_dense + lora_exp) +
        sum(2 * s.router_params for s in counts.experts),
        lora_params, ctx.assign_k,
        note=f"rank {r} on every linear and expert projection, router full rank (trained)")
