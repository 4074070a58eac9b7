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

import functools
import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf
from torch import nn

log = logging.getLogger(__name__)


def ep_size(cfg) -> int:
    """``hardware.ep_size`` of a run config (1 where the hardware config has none)."""
    return int(OmegaConf.select(cfg, "hardware.ep_size", default=1) or 1)


def ep_dense(cfg) -> str:
    """``hardware.ep_dense`` of a run config: how the dense part's optimizer state lives under EP, ``zero1`` (sharded
    over every rank, :mod:`.ep_optimizer`) or ``ddp`` (whole on every rank); ``zero1`` where the config has none."""
    from .ep_optimizer import EP_DENSE

    value = OmegaConf.select(cfg, "hardware.ep_dense", default="zero1")
    if value not in EP_DENSE:
        raise ValueError(f"hardware.ep_dense={value!r}: choose zero1 (the dense part's AdamW state sharded over every "
                         "rank, ZeRO stage 1) or ddp (whole on every rank)")
    return value


@dataclass
class _Sharded:
    experts: nn.Module
    names: list[str]  # the expert tensors' paths in ``experts`` (LoRA: parametrizations.<name>.original, .0.lora_A)
    num_experts: int  # global
    handles: list = field(default_factory=list)  # its state-dict hooks
    patch: object = None
    block: object = None


@dataclass
class ExpertParallel:
    """The installed EP state of one model: its meshes and the sharded experts modules."""

    ep_size: int
    ep_rank: int
    ep_group: object
    dp_group: object  # the ranks that own the same experts (one per data-parallel replica)
    world: int
    sharded: list[_Sharded] = field(default_factory=list)
    dense: str = "ddp"  # hardware.ep_dense: the dense part's optimizer state sharded (zero1) or whole (ddp)

    @property
    def local_parameters(self) -> list[nn.Parameter]:
        return [s.experts.get_parameter(n) for s in self.sharded for n in s.names]

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

    def reduce_over_ep(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the EP group (in place; e.g. the local experts' squared gradient norms)."""
        dist.all_reduce(values, group=self.ep_group)
        return values

    def clip_gradients(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole expert-parallel model (its coefficient rule)."""
        params = [p for p in parameters if p.grad is not None]
        expert_ids = {id(p) for p in self.local_parameters}
        total = self.global_norm([p.grad for p in params if id(p) not in expert_ids], norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
        return total


    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer``'s ``state_dict`` hold the local experts' states gathered over the EP group (every rank
        calls it, as Lightning's checkpoint dump does) and its ``load_state_dict`` keep this rank's slice."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        totals = {id(s.experts.get_parameter(n)): s.num_experts for s in self.sharded for n in s.names}
        experts = {i: totals[id(p)] for i, p in enumerate(params) if id(p) in totals}

        def gather(opt, state_dict):
            for i in sorted(experts):
                entry = state_dict["state"].get(i)
                if entry is not None:
                    state_dict["state"][i] = {k: self._gather(v, experts[i]) for k, v in entry.items()}
            return state_dict

        def keep_local(opt, state_dict):
            state_dict = dict(state_dict)
            state_dict["state"] = dict(state_dict["state"])
            for i in sorted(experts):
                entry = state_dict["state"].get(i)
                if entry is not None:
                    state_dict["state"][i] = {k: self._local(v, experts[i]) for k, v in entry.items()}
            return state_dict

        optimizer.register_state_dict_post_hook(gather)
        optimizer.register_load_state_dict_pre_hook(keep_local)

    def _gather(self, value, total: int):
        local = total // self.ep_size
        if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != local:
            return value
        parts = [torch.empty_like(value) for _ in range(self.ep_size)]
        dist.all_gather(parts, value.contiguous(), group=self.ep_group)
        return torch.cat(parts, dim=0)

    def _local(self, value, total: int):
        if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != total:
            return value
        local = total // self.ep_size
        return value[self.ep_rank * local:(self.ep_rank + 1) * local].clone()

    @torch.no_grad()
    def uninstall(self) -> None:
        """Every rank takes part in gathering the whole experts back into each experts module, whose own forward
        and expert count return: after fit, for the export and anything that runs the model on one rank."""
        for shard in self.sharded:
            for name in shard.names:
                param = shard.experts.get_parameter(name)
                param.data = self._gather(param.data, shard.num_experts)
                _remap_slices(shard.patch, shard.block, param, param,  # ESFT's masks over the whole experts
                              lambda rows, shard=shard: self._gather(rows.to(torch.uint8), shard.num_experts).bool())
            shard.experts.num_experts = shard.num_experts
            del shard.experts.forward, shard.experts.moe_lab_expert_parallel, shard.experts.moe_lab_expert_range
            for handle in shard.handles:
                handle.remove()
        self.sharded = []


def _dispatched(engine, hidden_states, top_k_index, top_k_weights):
    """The experts call under EP, in the input's dtype (as transformers' own EP forward returns it)."""
    return engine(hidden_states, top_k_index, top_k_weights).to(hidden_states.dtype)


def dispatch_of(experts: nn.Module):
    """``(ExpertParallel, AllToAllEP)`` of an experts module :func:`install` sharded, else None."""
    return getattr(experts, "moe_lab_expert_parallel", None)


def agreed_chunks(state: ExpertParallel, tokens: int, chunk_tokens: int, device) -> int:
    """How many chunks of ``chunk_tokens`` tokens every rank of the EP group runs: the most any rank needs (each
    dispatched call is collective, so a rank with fewer tokens runs empty chunks). One host sync."""
    count = torch.tensor([-(-tokens // chunk_tokens)], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=state.ep_group)
    return int(count.item())


def pair_dots(experts: nn.Module, x: torch.Tensor, ids: torch.Tensor, grad_out: torch.Tensor,
              chunk_tokens: int) -> torch.Tensor:
    """[N, m] fp32: ``<grad_out[t], E_ids[t, j](x[t])>`` for every (token, expert) pair of ``ids`` [N, m] (global
    ids), each pair run by its expert's owner through the dispatch, in token chunks. Only the weights' gradient of
    the dispatched call is taken (the experts' outputs come back through the combine all-to-all of the forward; no
    collective runs backward), so no gradient reaches ``x`` or the experts."""
    state, engine = dispatch_of(experts)
    out = torch.zeros(ids.shape, dtype=torch.float32, device=x.device)
    frozen = [p for p in experts.parameters(recurse=False) if p.requires_grad]
    for p in frozen:  # nothing of the experts' own graph is kept
        p.requires_grad_(False)
    try:
        for chunk in range(agreed_chunks(state, x.shape[0], chunk_tokens, x.device)):
            rows = slice(chunk * chunk_tokens, (chunk + 1) * chunk_tokens)
            weights = torch.ones(ids[rows].shape, dtype=torch.float32, device=x.device, requires_grad=True)
            with torch.enable_grad():
                y = engine(x[rows].detach(), ids[rows], weights)
                (dots,) = torch.autograd.grad(y, weights, grad_outputs=grad_out[rows].to(y.dtype))
            out[rows] = dots
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return out


@torch.no_grad()
def pair_mixture(experts: nn.Module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 chunk_tokens: int) -> torch.Tensor:
    """[N, H]: ``sum_j weights[t, j] E_ids[t, j](x[t])`` through the dispatch, in token chunks, without autograd."""
    state, engine = dispatch_of(experts)
    out = torch.zeros_like(x)
    for chunk in range(agreed_chunks(state, x.shape[0], chunk_tokens, x.device)):
        rows = slice(chunk * chunk_tokens, (chunk + 1) * chunk_tokens)
        out[rows] = engine(x[rows], ids[rows], weights[rows]).to(out.dtype)
    return out


def _shard_hooks(state: ExpertParallel, shard: _Sharded):
    def gather(module, state_dict, prefix, local_metadata):
        for name in shard.names:
            state_dict[prefix + name] = state._gather(state_dict[prefix + name], shard.num_experts)

    def keep_local(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for name in shard.names:
            key = prefix + name
            if key in state_dict:
                state_dict[key] = state._local(state_dict[key], shard.num_experts)

    return gather, keep_local


def _remap_slices(patch, block, old: nn.Parameter, new: nn.Parameter, rows_of) -> None:
    """ESFT's trained-slice masks of the packed tensor ``old`` moved to ``new`` with ``rows_of(mask)`` as their rows:
    the patch's optimizer masks, the block's gradient hooks (a new tensor gets its own hook) and the frozen-slice
    guard. Install localises them to a rank's experts; uninstall makes them whole again."""
    from ..moe.block import SliceGradMask

    mapped: dict[int, torch.Tensor] = {}  # one mask is shared by the three holders: mapped (gathered) once

    def rows_of(rows, _map=rows_of):
        if id(rows) not in mapped:
            mapped[id(rows)] = _map(rows)
        return mapped[id(rows)]

    for key, (param, rows) in list(patch.expert_slice_masks.items()):
        if param is old:
            patch.expert_slice_masks[key] = (new, rows_of(rows))
    for i, (param, rows) in enumerate(list(block.gradient_slice_masks)):
        if param is old:
            block.gradient_slice_masks[i] = (new, rows_of(rows))
            hook = getattr(new, "moe_lab_slice_hook", None)
            if hook is None:
                hook = new.moe_lab_slice_hook = SliceGradMask(None)
                new.register_hook(hook)
            hook.mask = block.gradient_slice_masks[i][1]
    guard = getattr(patch, "frozen_slice_guard", None)
    if guard is not None:
        guard.slices = [(new, rows_of(rows)) if param is old else (param, rows) for param, rows in guard.slices]


def ep_groups(world: int, ep_size: int) -> list[list[int]]:
    """The EP groups of a world: consecutive global ranks, ``ep_size`` each (the mesh :func:`install` builds), so on
    nodes of ``ep_size`` (or a multiple of it) GPUs every all-to-all stays inside a node; the ranks of one EP group
    hold every expert once, and the ranks at the same position of each group (a data-parallel group) the same ones."""
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"hardware.ep_size={ep_size} must divide the world size {world} (hardware.trainer.devices x "
                         "hardware.trainer.num_nodes)")
    return [list(range(start, start + ep_size)) for start in range(0, world, ep_size)]


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
    groups = ep_groups(world, ep_size)
    mesh = init_device_mesh(device_type, (world // ep_size, ep_size, 1), mesh_dim_names=("dp", "ep", "tp"))
    if dist.get_process_group_ranks(mesh["ep"].get_group()) not in groups:  # the layout the docs and plan describe
        raise RuntimeError(f"EP group {dist.get_process_group_ranks(mesh['ep'].get_group())} is not one of {groups}")
    state = ExpertParallel(ep_size=ep_size, ep_rank=mesh["ep"].get_local_rank(), ep_group=mesh["ep"].get_group(),
                           dp_group=mesh["dp"].get_group(), world=world)
    for view, block in zip(patch.views, patch.layers):
        experts, total = view.experts, view.num_experts
        if view.spec.weight_on_input or not view.layout.packed or not hasattr(experts, "num_experts"):
            raise ValueError(f"hardware.ep_size={ep_size}: {patch.spec.model_type}'s experts ({type(experts).__name__}) "
                             "are not transformers' packed experts with a (tokens, ids, weights) call; use "
                             "hardware.ep_size=1")
        if total % ep_size:
            raise ValueError(f"hardware.ep_size={ep_size} must divide the {total} experts of layer {view.index}")
        local = total // ep_size
        lo = state.ep_rank * local
        # every per-expert tensor, LoRA's parametrized base weights and adapters included (each rank adapts its own)
        names = [n for n, p in experts.named_parameters() if p.dim() >= 2 and p.shape[0] == total]
        shard = _Sharded(experts, names, total, patch=patch, block=block)
        for name in names:
            param = experts.get_parameter(name)
            sharded = nn.Parameter(param.detach()[lo:lo + local].clone(), requires_grad=param.requires_grad)
            owner, _, leaf = name.rpartition(".")
            setattr(experts.get_submodule(owner), leaf, sharded)
            _remap_slices(patch, block, param, sharded, lambda rows, lo=lo, local=local: rows[lo:lo + local])
        experts.num_experts = local
        experts.moe_lab_expert_range = (lo, lo + local)  # what moe-lab's expert masks index (moe/patch.py)
        engine = AllToAllEP(experts, mesh["ep"], mesh["tp"])
        experts.forward = functools.partial(_dispatched, engine)
        experts.moe_lab_expert_parallel = (state, engine)
        gather, keep_local = _shard_hooks(state, shard)
        shard.handles = [experts._register_state_dict_hook(gather),
                         experts._register_load_state_dict_pre_hook(keep_local, with_module=True)]
        state.sharded.append(shard)
    log.info("expert parallel: %d layers, %d of %d experts on EP rank %d of %d (%d data-parallel replicas); "
             "dispatch: transformers AllToAllEP", len(state.sharded), local, total, state.ep_rank, ep_size,
             world // ep_size)
    patch.expert_parallel = state
    return state


def dense_part_trains(model: nn.Module) -> bool:
    """Whether a parameter outside the expert tensors (DDP's ignore list) trains: else DDP has nothing to reduce
    (ESFT training only experts) and refuses to wrap the model."""
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    return any(p.requires_grad for name, p in model.named_parameters() if name not in ignored)


def _wrap_only_a_training_dense_part(strategy) -> None:
    """Make Lightning's DDP strategy leave the module unwrapped when its dense part does not train (decided when it
    wraps, after the method's ``setup``, e.g. ESFT's selection): the experts' gradients are moe-lab's to reduce."""
    setup_model, register_hooks = strategy._setup_model, strategy._register_ddp_hooks

    def wrap(model):
        if dense_part_trains(model):
            return setup_model(model)
        log.info("expert parallel: only expert tensors train, so DDP does not wrap the model (moe-lab reduces the "
                 "experts' gradients over the data-parallel replicas)")
        return model

    def hooks():
        if strategy.model is not strategy.lightning_module:
            register_hooks()

    strategy._setup_model, strategy._register_ddp_hooks = wrap, hooks


class ExpertParallelHooks(Callback):
    """The Lightning side of ``hardware.ep_size``: install EP at ``setup`` (after the process group exists, before
    DDP wraps the module, whose reducer then skips the expert tensors), make the optimizer's state gather and slice
    the experts at fit start (before a resumed state loads), and sum the experts' gradients at each window's last
    backward (before the callbacks read them and the module clips them, :meth:`ExpertParallel.clip_gradients`).
    ``dense``: ``hardware.ep_dense`` (the module's optimizer then shards the dense part's state, ``zero1``)."""

    def __init__(self, ep_size: int, dense: str = "ddp"):
        self.ep_size, self.dense = int(ep_size), dense
        self.state: ExpertParallel | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.state is not None:
            return
        from torch.nn.parallel import DistributedDataParallel

        self.state = install(pl_module.patch, self.ep_size, trainer.strategy.root_device.type)
        self.state.dense = self.dense
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            pl_module, self.state.parameter_names(pl_module))
        _wrap_only_a_training_dense_part(trainer.strategy)

    def on_fit_start(self, trainer, pl_module) -> None:
        from .ep_optimizer import DenseShardedAdamW

        for optimizer in trainer.optimizers:
            if not isinstance(optimizer, DenseShardedAdamW):  # which gathers its experts' state itself
                self.state.attach_optimizer(optimizer)

    def on_after_backward(self, trainer, pl_module) -> None:
        if not trainer.fit_loop._should_accumulate():
            self.state.sync_gradients()
