"""moe-lab's MoE block, installed in place of an HF sparse-MoE block.

It owns the HF block's children under the same names (so state-dict keys do not change), routes with
the registry's :class:`~moe_lab.moe.routing.RoutingRule` (through the HF router module, so HF's
``output_router_logits`` hooks keep recording), counts routing statistics and reproduces the family's
output signature.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.utils import parametrize, stateless

from .experts import expert_mixture, split_lora_mixture
from .registry import config_value
from .routing import router_logits, select_topk
from .stats import TokenContext, bincount_experts, in_backward_pass
from .view import MoELayerView, router_weight_of

_ROUTER_CLASSES: dict[type, type] = {}


def _moe_lab_router_forward(self, hidden_states):
    """Router forward after installation: ``(logits, weights, indices)`` from the installed routing policy, the
    logits moved to where the HF router returns them (registry ``router_logits_index``: HF records them there)."""
    policy = self.moe_lab_policy
    logits, weights, indices = policy(self, hidden_states)
    out = [weights, indices]
    out.insert(policy.view.spec.router_logits_index, logits)
    return tuple(out)


def split_router_output(spec, out: tuple) -> tuple:
    """``(logits, weights, indices)`` from a routed router's output (the inverse of its forward's ordering)."""
    rest = list(out)
    logits = rest.pop(spec.router_logits_index)
    return (logits, *rest)


def _restore_router(hf_class: type, state: dict):
    """Unpickle a routed router: rebuild its (dynamic) class from the HF class, then its state."""
    router = routed_router_class(hf_class).__new__(routed_router_class(hf_class))
    router.__setstate__(state)
    return router


def _reduce_router(self, protocol):
    return _restore_router, (type(self).__mro__[1], self.__getstate__())


def routed_router_class(hf_class: type) -> type:
    """A subclass of the HF router class whose forward runs moe-lab routing (hooks still match it).

    Created on demand, so it pickles through :func:`_restore_router` (patched models work with
    ``ddp_spawn`` and ``torch.save``)."""
    if hf_class not in _ROUTER_CLASSES:
        _ROUTER_CLASSES[hf_class] = type(
            f"MoeLab{hf_class.__name__}", (hf_class,),
            {"forward": _moe_lab_router_forward, "__reduce_ex__": _reduce_router},
        )
    return _ROUTER_CLASSES[hf_class]


class ConventionalRouting:
    """The family's own routing: ``(logits, top-k weights, top-k indices)`` as HF computes them."""

    def __init__(self, view: MoELayerView):
        self.rule = view.rule
        self.view = view

    def logits(self, router: nn.Module, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(router, "bias", None)
        weight = router_weight_of(router, self.view.spec.router_weight_attr)
        return router_logits(self.rule, x, weight, bias if isinstance(bias, torch.Tensor) else None)

    def __call__(self, router: nn.Module, x: torch.Tensor):
        logits = self.logits(router, x)
        weights, indices = select_topk(self.rule, logits, router.training, self.view.correction_bias)
        return logits, weights, indices


def autocast_expert_weights(experts: nn.Module, device_type: str) -> dict[str, torch.Tensor]:
    """The packed 3-D expert tensors cast to autocast's dtype, when autocast is on for ``device_type`` and they
    are fp32 master weights; ``{}`` otherwise.

    HF's grouped / batched expert matmuls are not autocast-enabled: under ``bf16-mixed`` with fp32 master
    weights they cast the activations UP to fp32 and run the experts (most of an MoE's FLOPs) in fp32. Casting
    the weights (a differentiable ``.to``, so the fp32 parameters get the gradients) runs them in bf16, as
    autocast does for every ``F.linear``."""
    if not torch.is_autocast_enabled(device_type):
        return {}
    dtype = torch.get_autocast_dtype(device_type)
    return {name: p.to(dtype) for name, p in experts.named_parameters(recurse=False)
            if p.dim() == 3 and p.dtype == torch.float32 and dtype != torch.float32}


def sparse_mixture(block: MoEBlock, x, logits, weights, indices) -> torch.Tensor:
    """Conventional mixture [N, H]: the HF experts module run on the selected (token, expert) pairs
    (:func:`~moe_lab.moe.experts.expert_mixture`: the routing weight on the expert output, or input); with split
    LoRA on packed experts (``block.split_lora``), the base weights and the adapters' rank-r steps on the pairs
    (:func:`~moe_lab.moe.experts.split_lora_mixture`), never the merged weights."""
    view = block.view.obj
    if block.split_lora and splits_lora(view):
        return split_lora_mixture(view, x, weights, indices)
    return expert_mixture(view, x, weights, indices)


def splits_lora(view) -> bool:
    """Whether LoRA on ``view``'s experts can run split: packed tensors (not DBRX's rows) weighted on the output
    (not Llama 4's weight-scaled inputs), with adapters installed."""
    experts = view.experts
    if hasattr(experts, "moe_lab_expert_parallel"):  # EP: the dispatched call, on each rank's adapted experts
        return False
    return (view.layout.packed and not view.spec.weight_on_input and parametrize.is_parametrized(experts)
            and getattr(experts, "has_gate", True) and not getattr(experts, "has_post_expert_norm", False))


class SliceGradMask:
    """Gradient hook keeping only the gradient of the expert slices where ``mask`` (over the leading axis) is True."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        keep = self.mask.to(grad.device).view(-1, *([1] * (grad.dim() - 1)))
        return grad * keep


def _slice_hook(param: nn.Parameter, mask: torch.Tensor) -> None:
    """Register ``param``'s :class:`SliceGradMask`, kept as ``param.moe_lab_slice_hook`` (expert parallelism
    changes its mask when it shards or gathers the experts)."""
    param.moe_lab_slice_hook = SliceGradMask(mask)
    param.register_hook(param.moe_lab_slice_hook)


class MoEBlock(nn.Module):
    """One MoE layer under moe-lab. Also the per-layer handle exposed as ``MoEPatch.layers``."""

    def __init__(self, view: MoELayerView, context: TokenContext):
        super().__init__()
        for name, child in view.block.named_children():
            self.add_module(name, child)
        # the HF block's own tensors (e.g. MiniMax-M2's e_score_correction_bias buffer), under the same names
        for name, param in view.block.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in view.block.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name not in view.block._non_persistent_buffers_set)
        self.view = _Frozen(view)
        self.context = _Frozen(context)
        self.index = view.index
        self.num_experts = view.num_experts
        self.top_k = view.top_k
        self.train(view.block.training)
        # how routed experts are combined: ``mixer(block, x, logits, weights, indices) -> [N, H]``
        self.mixer = sparse_mixture
        # LoRA on packed experts as rank-r steps on the routed rows (methods/lora.py ``experts: split``)
        self.split_lora = False
        # plain tensors, not buffers: DDP would broadcast buffers from rank 0 and overwrite local counts
        self.counts = torch.zeros(self.num_experts, dtype=torch.long)
        self.total_counts = torch.zeros(self.num_experts, dtype=torch.long)
        self.gradient_slice_masks: list[tuple[nn.Parameter, torch.Tensor]] = []

    def synced_hf_block(self) -> nn.Module:
        """The HF block this one stands in for, its own tensors (e.g. a correction-bias buffer) set to this block's:
        moves, casts and ``to_empty`` while installed replace them here only. Its children are this block's."""
        block = self.view.obj.block
        for name in block._parameters:
            block._parameters[name] = self._parameters.get(name)
        for name in block._buffers:
            block._buffers[name] = self._buffers.get(name)
        return block

    @property
    def _is_hf_initialized(self) -> bool:
        """transformers' "weights initialised" flag (``PreTrainedModel._initialize_weights`` skips a module that has
        it): the HF block's, as this block's initialisation is the HF block's (:mod:`moe_lab.moe.hf_init`)."""
        return getattr(self.view.obj.block, "_is_hf_initialized", False)

    @_is_hf_initialized.setter
    def _is_hf_initialized(self, value: bool) -> None:
        self.view.obj.block._is_hf_initialized = value

    def hook_gradient_slices(self, param: nn.Parameter, mask: torch.Tensor) -> None:
        """Zero the gradient of ``param``'s expert slices outside ``mask`` [E] (re-hooked after unpickling:
        torch drops tensor hooks when it pickles parameters)."""
        self.gradient_slice_masks.append((param, mask))
        _slice_hook(param, mask)

    def __setstate__(self, state):
        super().__setstate__(state)
        for param, mask in self.__dict__.get("gradient_slice_masks", []):
            _slice_hook(param, mask)

    @property
    def spec(self):
        return self.view.obj.spec

    @property
    def forced_experts(self) -> list[int]:
        """Experts in every token's active set (Expert Condenser's condensers); empty when none."""
        ids = getattr(self, "forced_expert_ids", None)
        if ids is None or not ids.numel() or bool((ids < 0).any()):
            return []
        return ids.tolist()

    def reset_counts(self) -> None:
        """Zero ``counts`` (tokens routed per expert since the last reset). ``total_counts`` keeps running."""
        self.counts.zero_()

    def _count(self, indices: torch.Tensor, batch: int, seq: int) -> None:
        context = self.context.obj
        if not (self.training or context.calibrating) or in_backward_pass():
            return
        with torch.no_grad():
            counts = bincount_experts(indices, context.token_mask(batch, seq), self.num_experts)
            if self.counts.device != counts.device:
                self.counts = self.counts.to(counts.device)
                self.total_counts = self.total_counts.to(counts.device)
            self.counts += counts
            self.total_counts += counts

    def _jitter(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        noise = config_value(self.view.obj.config, spec.jitter_field) if spec.jitter_field else None
        if self.training and noise is not None and (noise > 0 or spec.jitter_when_set):  # the same random draws
            for _ in range(spec.jitter_passes):
                x = x * torch.empty_like(x).uniform_(1.0 - noise, 1.0 + noise)
        return x

    def forward(self, hidden_states: torch.Tensor):
        # the branches run in the HF block's order, so that autograd accumulates the input gradient
        # in the same order and forwards and gradients are bit-identical to vanilla HF
        spec = self.spec
        batch, seq, hidden = hidden_states.shape
        jittered = self._jitter(hidden_states)
        x = jittered.reshape(-1, hidden)
        # None: no shared experts (a family whose config may have none, e.g. moe_num_shared_experts=0)
        shared_module = getattr(self, spec.shared_attr, None) if spec.shared_attr else None
        shared = shared_module(x) if spec.shared_first and shared_module is not None else None
        logits, weights, indices = split_router_output(spec, getattr(self, spec.router_attr)(x))
        if self.view.obj.rule.weights_in_input_dtype:
            weights = weights.to(x.dtype)
        self._count(indices, batch, seq)
        if spec.shared_after_router:
            shared = shared_module(x)
        own_view = spec.experts_own_view and jittered is hidden_states  # (no such family jitters)
        experts_x = hidden_states.reshape(-1, hidden) if own_view else x
        if parametrize.is_parametrized(self.view.obj.expert_module):  # LoRA: merge the adapters once per forward, not per expert
            with parametrize.cached():
                out = self.mixer(self, experts_x, logits, weights, indices)
        else:
            cast = autocast_expert_weights(self.experts, x.device.type)
            with stateless._reparametrize_module(self.experts, cast) if cast else contextlib.nullcontext():
                out = self.mixer(self, experts_x, logits, weights, indices)
        if spec.output_scaling_field:
            out = out * getattr(self.view.obj.config, spec.output_scaling_field)
        if shared_module is not None:
            if shared is None:
                shared = shared_module(hidden_states).reshape(-1, hidden) if own_view else shared_module(x)
            if spec.shared_gate_attr is not None:
                shared = torch.sigmoid(getattr(self, spec.shared_gate_attr)(x)) * shared
            config = self.view.obj.config
            if spec.fp32_combine_field and getattr(config, spec.fp32_combine_field, False):
                out = (out.float() + shared.float()).to(x.dtype)
            elif spec.shared_combine_field and getattr(config, spec.shared_combine_field) == "average":
                out = (out + shared) / 2
            else:
                out = out + shared
        if spec.output_norm_attr:
            out = getattr(self, spec.output_norm_attr)(out)
        out = out.reshape(batch, seq, hidden)
        if spec.returns_router_logits:
            return out, logits
        return (out, weights) if spec.returns_router_scores else out

    def extra_repr(self) -> str:
        return f"layer={self.index}, experts={self.num_experts}, top_k={self.top_k}"


class _Frozen:
    """Holds a plain reference without registering it as a submodule."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

