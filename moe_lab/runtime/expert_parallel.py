"""Expert parallelism (``hardware.ep_size``) on transformers' own EP engine, behind moe-lab's routing.

The seam is the HF experts module's call ``experts(hidden_states, top_k_index, top_k_weights)``, which moe-lab's
:class:`~moe_lab.moe.block.MoEBlock` makes after its routing (condenser biases, frozen routers, the method's mixer).
:func:`install` gives each rank the contiguous slice of ``E / ep_size`` experts its EP rank owns and replaces that
call by transformers' ``AllToAllEP`` (``transformers.distributed.expert_parallel``): each (token, expert) pair goes
to its owner with one all-to-all, the owner runs the HF experts forward on its local ids, the outputs come back with
a second all-to-all and are weighted and summed on the sender. The routing weights stay on the sender, so their
gradient (the router's) flows as in the single-process run. moe-lab writes no collective of its own for the tokens.

The dense part stays data parallel (DDP over every rank; the expert tensors are excluded from DDP's reducer). The
gradient of a local expert arrives through the all-to-all backward as the sum over its EP group's ranks of their
losses' gradients: :meth:`ExpertParallel.sync_gradients` adds the other data-parallel replicas' sums (the ranks
that own the same experts) and divides by the world size, as DDP averages the dense gradients. Gradient norms (for
clipping and logging) sum the local experts' squares over the EP group (:meth:`ExpertParallel.global_norm`).

``state_dict`` gathers every expert tensor over the EP group (a collective: every rank calls it, as Lightning's
checkpoint dump does), and ``load_state_dict`` takes full tensors and keeps the local slice, so a checkpoint or an
export holds the model as a single-process run would, whatever ``ep_size`` wrote it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

#: methods whose expert computation is the HF experts call (the seam); the others compute on the packed weights
#: themselves and are refused under EP, each with its reason
EP_METHODS = ("sft", "frozen_router", "sft_aux_free", "condenser", "condense_sft")
EP_REFUSED = {
    "densemixer": "its router gradient needs every expert's output for every token (the inactive experts' pass runs "
                  "on the packed weights, outside the dispatched experts call)",
    "esft_token": "its training pass runs the trained expert slices on the packed weights itself",
    "esft_gate": "its training pass runs the trained expert slices on the packed weights itself",
    "compressed_experts": "its compressed mixture runs the experts on the packed weights itself",
    "kd": "the teacher and the dense student are not expert parallel",
}


def check_method(method: str, ep_size: int, lora_experts: bool = False) -> None:
    """Refuse, by name, a method (or LoRA on experts) that cannot run under ``hardware.ep_size > 1``."""
    if ep_size <= 1:
        return
    if method in EP_REFUSED:
        raise ValueError(f"method={method} under hardware.ep_size={ep_size}: {EP_REFUSED[method]}. Use hardware.ep_size=1 "
                         "(DDP, ZeRO or FSDP), or one of the methods that run under EP: " + ", ".join(EP_METHODS))
    if method not in EP_METHODS:
        raise ValueError(f"method={method} under hardware.ep_size={ep_size}: not proven under expert parallelism; the "
                         "methods that run under EP: " + ", ".join(EP_METHODS))
    if lora_experts:
        raise ValueError(f"method.lora on experts under hardware.ep_size={ep_size}: split LoRA runs the adapters on the "
                         "packed expert weights outside the dispatched experts call; drop 'experts' from "
                         "method.lora.targets or use hardware.ep_size=1")


@dataclass
class _Sharded:
    experts: nn.Module
    names: list[str]  # the expert tensors' attribute names in ``experts``
    num_experts: int  # global


@dataclass
class ExpertParallel:
    """The installed EP state of one model: its meshes and the sharded experts modules."""

    ep_size: int
    ep_rank: int
    ep_group: object
    dp_group: object  # the ranks that own the same experts (one per data-parallel replica)
    world: int
    sharded: list[_Sharded] = field(default_factory=list)

    @property
    def local_parameters(self) -> list[nn.Parameter]:
        return [getattr(s.experts, n) for s in self.sharded for n in s.names]

    def parameter_names(self, root: nn.Module) -> list[str]:
        """The expert tensors' names in ``root`` (for DDP's ignore list)."""
        ids = {id(p) for p in self.local_parameters}
        return [name for name, p in root.named_parameters() if id(p) in ids]

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """After the window's last backward: sum each local expert's gradient over the data-parallel replicas and
        divide by the world size (the mean over ranks that DDP takes of the dense gradients)."""
        grads = [p.grad for p in self.local_parameters if p.grad is not None]
        for grad in grads:
            if self.world // self.ep_size > 1:
                dist.all_reduce(grad, group=self.dp_group)
            grad.div_(self.world)

    def global_norm(self, dense: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The gradient norm of the whole model: the ``dense`` gradients (equal on every rank) with the local expert
        gradients of every rank of the EP group (equal across data-parallel replicas after :meth:`sync_gradients`)."""
        if math.isinf(norm_type):
            raise ValueError("the inf-norm is not supported under hardware.ep_size > 1; clip by the 2-norm")

        def power(grads) -> torch.Tensor:
            if not grads:
                return torch.zeros((), dtype=torch.float64)
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads])
            return norms.double().pow(norm_type).sum()

        experts = power([p.grad for p in self.local_parameters if p.grad is not None])
        dist.all_reduce(experts, group=self.ep_group)
        return (power(dense) + experts).pow(1.0 / norm_type).float()

    def clip_gradients(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole expert-parallel model (its coefficient rule)."""
        params = [p for p in parameters if p.grad is not None]
        expert_ids = {id(p) for p in self.local_parameters}
        total = self.global_norm([p.grad for p in params if id(p) not in expert_ids], norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
        return total


def _shard_hooks(state: ExpertParallel, shard: _Sharded):
    def gather(module, state_dict, prefix, local_metadata):
        for name in shard.names:
            key = prefix + name
            local = state_dict[key]
            parts = [torch.empty_like(local) for _ in range(state.ep_size)]
            dist.all_gather(parts, local.contiguous(), group=state.ep_group)
            state_dict[key] = torch.cat(parts, dim=0)

    def keep_local(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for name in shard.names:
            key = prefix + name
            value = state_dict.get(key)
            if value is not None and value.shape[0] == shard.num_experts:
                local = value.shape[0] // state.ep_size
                state_dict[key] = value[state.ep_rank * local:(state.ep_rank + 1) * local]

    return gather, keep_local


def install(patch, ep_size: int, device_type: str = "cpu") -> ExpertParallel:
    """Shard every MoE layer's experts of ``patch`` over EP groups of ``ep_size`` ranks (consecutive global ranks)
    and dispatch them with transformers' ``AllToAllEP``. Needs an initialised process group whose world size is a
    multiple of ``ep_size``, and every layer's expert count a multiple of it."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import AllToAllEP

    if not dist.is_initialized():
        raise ValueError(f"hardware.ep_size={ep_size} needs a distributed run: set hardware.trainer.devices (a "
                         "multiple of ep_size) under a DDP strategy")
    world = dist.get_world_size()
    if world % ep_size:
        raise ValueError(f"hardware.ep_size={ep_size} must divide the world size {world} (hardware.trainer.devices x "
                         "nodes)")
    mesh = init_device_mesh(device_type, (world // ep_size, ep_size, 1), mesh_dim_names=("dp", "ep", "tp"))
    state = ExpertParallel(ep_size=ep_size, ep_rank=mesh["ep"].get_local_rank(), ep_group=mesh["ep"].get_group(),
                           dp_group=mesh["dp"].get_group(), world=world)
    for view in patch.views:
        experts, total = view.experts, view.num_experts
        if view.spec.weight_on_input or not view.layout.packed or not hasattr(experts, "num_experts"):
            raise ValueError(f"hardware.ep_size={ep_size}: {patch.spec.model_type}'s experts ({type(experts).__name__}) "
                             "are not transformers' packed experts with a (tokens, ids, weights) call; use "
                             "hardware.ep_size=1")
        if total % ep_size:
            raise ValueError(f"hardware.ep_size={ep_size} must divide the {total} experts of layer {view.index}")
        local = total // ep_size
        lo = state.ep_rank * local
        names = [n for n, p in experts.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == total]
        for name in names:
            param = getattr(experts, name)
            setattr(experts, name, nn.Parameter(param.detach()[lo:lo + local].clone(),
                                                requires_grad=param.requires_grad))
        experts.num_experts = local
        shard = _Sharded(experts, names, total)
        engine = AllToAllEP(experts, mesh["ep"], mesh["tp"])
        experts.forward = engine
        gather, keep_local = _shard_hooks(state, shard)
        experts._register_state_dict_hook(gather)
        experts._register_load_state_dict_pre_hook(keep_local, with_module=True)
        state.sharded.append(shard)
    log.info("expert parallel: %d layers, %d of %d experts on EP rank %d of %d (%d data-parallel replicas); "
             "dispatch: transformers AllToAllEP", len(state.sharded), local, total, state.ep_rank, ep_size,
             world // ep_size)
    patch.expert_parallel = state
    return state
