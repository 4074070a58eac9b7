"""Exact parameter counts and measured non-expert FLOPs/activations of a model built on the meta device.

No weights are read or allocated: the HF model is instantiated under ``torch.device("meta")`` from its config,
its routed experts are stubbed (their cost is data-dependent and counted analytically by :mod:`.estimate`),
and one forward + backward pass runs under ``torch.utils.flop_counter.FlopCounterMode`` (matmul / attention
FLOPs by module) while ``saved_tensors_hooks`` sums the bytes autograd keeps for the backward pass.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from transformers import AttentionInterface

from ..moe.view import MoELayerView, find_moe_layers

_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)$")  # DBRX: transformer.blocks.<i>


def meta_model(config, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The HF causal LM for ``config`` with every tensor on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def moe_views(model: nn.Module) -> list[MoELayerView]:
    """The model's MoE layers, or ``[]`` for a dense model."""
    try:
        return find_moe_layers(model)
    except ValueError:
        return []


def decoder_layers(model: nn.Module) -> dict[int, str]:
    """Decoder-layer index -> module path (``model.layers.<i>``)."""
    return {int(m.group(1)): name for name, module in model.named_modules() if (m := _LAYER.search(name))}


@dataclass
class ExpertShape:
    """Per-layer routed-expert geometry the analytic part needs."""

    layer: int
    num_experts: int
    top_k: int
    hidden: int
    width: int  # intermediate width I of one expert
    params_per_expert: int  # every packed tensor's slice (weights and biases)
    matmul_params_per_expert: int  # weights only (2 FLOPs each per token)
    router_params: int


@dataclass
class ParamCounts:
    total: int
    input_embedding: int
    output_embedding: int  # 0 when tied
    routed: int  # all routed-expert parameters
    router: int
    shared: int
    per_layer_total: dict[int, int] = field(default_factory=dict)
    experts: list[ExpertShape] = field(default_factory=list)

    def active(self, experts_per_token: dict[int, int] | None = None) -> int:
        """Parameters used per token: everything but the routed experts, plus ``k`` of them per layer."""
        used = sum((experts_per_token or {}).get(s.layer, s.top_k) * s.params_per_expert for s in self.experts)
        return self.total - self.routed + used

    def per_layer_active(self) -> dict[int, int]:
        out = dict(self.per_layer_total)
        for s in self.experts:
            out[s.layer] -= (s.num_experts - s.top_k) * s.params_per_expert
        return out


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def count_parameters(model: nn.Module) -> ParamCounts:
    """Exact parameter counts by role, from the uniform MoE view (embeddings, routed, router, shared, per layer)."""
    views = moe_views(model)
    emb_in = model.get_input_embeddings()
    emb_out = model.get_output_embeddings()
    tied = emb_out is not None and emb_out.weight is emb_in.weight
    shapes, routed, router, shared = [], 0, 0, 0
    for v in views:
        packed = v.expert_parameters()
        matmul = {n: p for n, p in packed.items() if p.dim() == 3}
        per_expert = sum(p.numel() for p in packed.values()) // v.num_experts
        width = min(min(p.shape[1:]) for p in matmul.values())
        shapes.append(ExpertShape(v.index, v.num_experts, v.top_k, int(model.config.hidden_size), int(width),
                                  per_expert, sum(p.numel() for p in matmul.values()) // v.num_experts,
                                  _numel(v.router)))
        routed += per_expert * v.num_experts
        router += _numel(v.router)
        shared += _numel(v.shared) + _numel(v.shared_gate)
    per_layer = {i: _numel(model.get_submodule(name)) for i, name in decoder_layers(model).items()}
    return ParamCounts(sum(p.numel() for p in model.parameters()), emb_in.weight.numel(),
                       0 if tied or emb_out is None else _numel(emb_out), routed, router, shared, per_layer, shapes)


@dataclass
class Measured:
    """Non-expert costs of one forward + backward pass over ``tokens`` tokens (routed experts stubbed)."""

    tokens: int
    forward: dict[str, int]  # "layer.<i>" | "other" -> FLOPs
    backward: dict[str, int]
    saved_bytes: dict[str, int]  # activation bytes autograd keeps, by layer

    def total(self, part: str) -> int:
        return sum(getattr(self, part).values())


class _Counter(TorchDispatchMode):
    """FLOPs of every aten op with a formula in torch's flop registry, attributed to ``where["layer"]``."""

    def __init__(self):
        super().__init__()
        self.where = {"layer": "other"}
        self.counts: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
        self.phase = "forward"
        self.registry = FlopCounterMode(display=False).flop_registry

    def add(self, flops: int) -> None:
        bucket = self.counts[self.phase]
        bucket[self.where["layer"]] = bucket.get(self.where["layer"], 0) + int(flops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = self.registry.get(func._overloadpacket)
        if count is not None:
            self.add(count(*args, **kwargs, out_val=out))
        return out


_ACTIVE: list[_Counter] = []


def _context_length(seq: int, window: int | None) -> float:
    """Mean number of keys a causal query attends to (within ``window`` when sliding)."""
    if not window or window >= seq:
        return (seq + 1) / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


class _FlashLike(torch.autograd.Function):
    """Causal fused attention as FlashAttention executes it: FLOPs 2*B*h*S*ctx*(d_qk + d_v) forward and
    2*B*h*S*ctx*(3*d_qk + 2*d_v) backward (QK^T recomputed); saves q, k, v, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, window):
        b, h, s, d_qk = q.shape
        d_v = v.shape[-1]
        keys = _context_length(s, window)
        ctx.flops_bwd = 2 * b * h * s * keys * (3 * d_qk + 2 * d_v)
        if _ACTIVE:
            _ACTIVE[-1].add(2 * b * h * s * keys * (d_qk + d_v))
        out = q.new_empty(b, s, h, d_v)
        ctx.save_for_backward(q, k, v, out, q.new_empty(b, h, s, dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, *_ = ctx.saved_tensors
        if _ACTIVE:
            _ACTIVE[-1].add(ctx.flops_bwd)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def _flash_like_attention(module, query, key, value, attention_mask, **kwargs):
    return _FlashLike.apply(query, key, value, kwargs.get("sliding_window")), None


AttentionInterface.register("moe_lab_flops", _flash_like_attention)


def _stub_experts(views: list[MoELayerView]) -> None:
    for v in views:
        v.experts.forward = lambda hidden_states, *args, **kwargs: torch.zeros_like(hidden_states)


def measure(model: nn.Module, batch: int, seq_len: int, train_non_experts: bool = True) -> Measured:
    """Run one forward and one backward pass on the meta device; FLOPs and saved activations by layer.

    Attention runs as causal fused (Flash-style) attention, whatever the config's implementation.
    ``train_non_experts=False`` freezes every parameter (autograd then skips their weight gradients) while
    the input still needs a gradient, so input gradients flow through every layer (ESFT, LoRA's frozen base).
    """
    _stub_experts(moe_views(model))
    model.config._attn_implementation = "moe_lab_flops"
    for module in model.modules():
        if getattr(module, "config", None) is not None and hasattr(module.config, "_attn_implementation"):
            module.config._attn_implementation = "moe_lab_flops"
    for p in model.parameters():
        p.requires_grad_(train_non_experts)
    layers = decoder_layers(model)
    counter = _Counter()
    saved: dict[str, int] = {}
    seen: dict[int, torch.Tensor] = {}  # holds the counted (meta) tensors: a freed one's id could be reused

    def pack(t):
        base = t._base if t._base is not None else t
        if id(base) not in seen:
            seen[id(base)] = base
            where = counter.where["layer"]
            saved[where] = saved.get(where, 0) + base.numel() * base.element_size()
        return t

    def enter(i):
        return lambda *_: counter.where.update(layer=f"layer.{i}")

    handles = []
    for i, name in layers.items():
        module = model.get_submodule(name)
        handles += [module.register_forward_pre_hook(enter(i)),
                    module.register_forward_hook(lambda *_: counter.where.update(layer="other")),
                    module.register_full_backward_pre_hook(enter(i))]
    dtype = next(model.parameters()).dtype
    embeds = torch.empty(batch, seq_len, model.config.hidden_size, device="meta", dtype=dtype, requires_grad=True)
    _ACTIVE.append(counter)
    try:
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # an explicit 4-D mask: transformers builds none on the meta device, and the layers of sparse-attention
            # families (DeepSeek-V3.2's DSA, GLM-MoE-DSA, ...) index it; the counts of every other family are the same
            mask = torch.ones(batch, 1, seq_len, seq_len, dtype=torch.bool, device="meta")
            try:
                logits = model(inputs_embeds=embeds, attention_mask=mask).logits
            except NotImplementedError as err:  # a data-dependent op (torch.nonzero) has no meta value
                raise ValueError(f"{model.config.model_type}: its forward cannot run on the meta device "
                                 f"({str(err).split(',')[0]}), so its costs cannot be measured without "
                                 "weights") from None
            loss = logits.float().sum()
        counter.phase, counter.where["layer"] = "backward", "other"
        with counter:
            loss.backward()
    finally:
        _ACTIVE.pop()
        for h in handles:
            h.remove()
    keys = [f"layer.{i}" for i in sorted(layers)] + ["other"]
    fwd, bwd = counter.counts["forward"], counter.counts["backward"]
    return Measured(batch * seq_len, {k: fwd.get(k, 0) for k in keys}, {k: bwd.get(k, 0) for k in keys},
                    {k: saved.get(k, 0) for k in keys})


@contextlib.contextmanager
def quiet_init():
    """Silence transformers' weight-init chatter while building meta models."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)
