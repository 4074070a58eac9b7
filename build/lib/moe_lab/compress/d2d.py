"""Dense-to-dense (D2D) pruning, the MoE -> dense paper's baseline (App. M, Tables 3, 6, 13): Minitron-style
structured pruning of a dense decoder (Qwen3 / Qwen2 / Llama / Mistral layout) to a smaller vanilla model of the
same class, then distillation from the dense teacher (``method=kd``).

Importance (Minitron's activation-based scores, from calibration batches, real tokens only):
- embedding channel i: |LN(X)_i| at every RMSNorm over the hidden size (both per decoder layer and the final one);
- MLP neuron i of a layer: |a_i|, a = act(gate) * up, the down projection's input;
- attention head h of a layer: ||o_h||_2, o_h = head h's attention output (the o projection's input);
- layer: the rise of the calibration LM loss when that one layer is skipped (depth pruning).
Each score is aggregated per sequence by the mean over its tokens and over sequences by the L2 norm (Minitron's
(batch L2, sequence mean) aggregation, as moe-lab reads it); a layer's KV head scores the sum of its query heads'.

:func:`prune_dense` keeps the most important layers (in order), channels, neurons, KV heads and, inside every kept
KV group, the same number of query heads, and writes them into a fresh model of the teacher's class.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import transformers
from torch import nn

from .dense import build_uninitialised

SUPPORTED = ("qwen3", "qwen2", "llama", "mistral")


@dataclass(frozen=True)
class D2DTarget:
    """The pruned architecture (Table 13's columns)."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int

    @classmethod
    def of(cls, config) -> D2DTarget:
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                   config.num_attention_heads, config.num_key_value_heads)


def check_target(config, target: D2DTarget) -> None:
    """Every target size must be in [1, the teacher's] and the query heads a multiple of the KV heads."""
    if config.model_type not in SUPPORTED:
        raise ValueError(f"D2D pruning supports dense {', '.join(SUPPORTED)} models, got {config.model_type!r}")
    source = D2DTarget.of(config)
    for field, value in asdict(target).items():
        if not 1 <= int(value) <= getattr(source, field):
            raise ValueError(f"d2d target {field}={value} must be between 1 and the teacher's {getattr(source, field)}")
    if target.num_attention_heads % target.num_key_value_heads:
        raise ValueError(f"d2d target num_attention_heads={target.num_attention_heads} must be a multiple of "
                         f"num_key_value_heads={target.num_key_value_heads} (the same query heads per KV group)")


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class _Aggregate:
    """Per-unit (batch L2, sequence mean) aggregation of non-negative token values."""

    def __init__(self):
        self.sq = None

    def add(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        """``values`` [B, S, U] >= 0, ``mask`` [B, S]: adds (mean over each sequence's real tokens)^2."""
        m = mask.to(values.dtype).unsqueeze(-1)
        mean = (values * m).sum(1) / m.sum(1).clamp_min(1.0)
        sq = mean.double().pow(2).sum(0)
        self.sq = sq if self.sq is None else self.sq + sq

    def value(self) -> torch.Tensor:
        return self.sq.sqrt()


def aggregate(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sqrt(sum_b (mean_{s real} v_{b,s,u})^2) per unit u (float64)."""
    agg = _Aggregate()
    agg.add(values, mask)
    return agg.value()


@torch.no_grad()
def activation_importance(model: nn.Module, batches: Iterable[dict]) -> dict:
    """``{"channels": [H], "neurons": {layer: [I]}, "heads": {layer: [n_heads]}}`` (float64) of ``model``
    on calibration ``batches`` (input_ids, attention_mask)."""
    config = model.config
    check_target(config, D2DTarget.of(config))
    layers = model.model.layers
    d = _head_dim(config)
    channels, neurons, heads = _Aggregate(), {i: _Aggregate() for i in range(len(layers))}, \
        {i: _Aggregate() for i in range(len(layers))}
    state = {}
    hooks = []
    norms = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    for norm in norms + [model.model.norm]:
        hooks.append(norm.register_forward_hook(lambda mod, args, out: channels.add(out.abs().float(), state["mask"])))
    for i, layer in enumerate(layers):
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(
            lambda mod, args, i=i: neurons[i].add(args[0].abs().float(), state["mask"])))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda mod, args, i=i: heads[i].add(
                args[0].float().unflatten(-1, (-1, d)).norm(dim=-1), state["mask"])))
    try:
        for batch in batches:
            mask = batch.get("attention_mask")
            mask = torch.ones_like(batch["input_ids"]) if mask is None else mask
            state["mask"] = mask.bool()
            model(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    if channels.sq is None:
        raise ValueError("d2d importance: no calibration batches")
    return {"channels": channels.value(), "neurons": {i: a.value() for i, a in neurons.items()},
            "heads": {i: a.value() for i, a in heads.items()}}


@torch.no_grad()
def lm_loss(model: nn.Module, batches: list[dict]) -> float:
    """Mean next-token cross-entropy over the real tokens of ``batches``."""
    total, count = 0.0, 0
    for batch in batches:
        mask = batch.get("attention_mask")
        mask = torch.ones_like(batch["input_ids"]) if mask is None else mask
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False).logits.float()
        labels = batch["input_ids"][:, 1:].masked_fill(~mask[:, 1:].bool(), -100)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           ignore_index=-100, reduction="sum")
        total, count = total + float(loss), count + int((labels != -100).sum())
    return total / max(count, 1)


class skip_layers:
    """Context manager: the given decoder layers return their input unchanged (depth pruning, exactly)."""

    def __init__(self, model: nn.Module, indices: Iterable[int]):
        self.layers = [model.model.layers[i] for i in indices]
        self.handles = []

    def __enter__(self):
        def skip(module, args, kwargs, output):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        self.handles = [layer.register_forward_hook(skip, with_kwargs=True) for layer in self.layers]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def layer_importance(model: nn.Module, batches: list[dict]) -> torch.Tensor:
    """[L] float64: the calibration LM loss with layer i skipped minus the full model's (higher = keep)."""
    base = lm_loss(model, batches)
    out = []
    for i in range(len(model.model.layers)):
        with skip_layers(model, [i]):
            out.append(lm_loss(model, batches) - base)
    return torch.tensor(out, dtype=torch.float64)


def _top(score: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n largest scores (ties to the lower index), in increasing index order."""
    order = torch.sort(-score.double(), stable=True).indices[: int(n)]
    return order.sort().values


def keep_plan(config, importance: dict, layer_scores: torch.Tensor | None, target: D2DTarget) -> dict:
    """What survives: ``layers`` (kept decoder layers, in order), ``channels``, per kept layer ``neurons``,
    ``kv_heads`` and ``q_heads`` (query heads, grouped by kept KV head, each group's best in index order)."""
    check_target(config, target)
    L = config.num_hidden_layers
    if target.num_hidden_layers < L and layer_scores is None:
        raise ValueError("d2d target num_hidden_layers < the teacher's: depth pruning needs layer importance")
    layers = list(range(L)) if target.num_hidden_layers == L else _top(layer_scores, target.num_hidden_layers).tolist()
    group = config.num_attention_heads // config.num_key_value_heads
    per_group = target.num_attention_heads // target.num_key_value_heads
    if per_group > group:
        raise ValueError(f"d2d target: {per_group} query heads per KV head exceed the teacher's {group}: keep more "
                         "KV heads (num_key_value_heads)")
    plan = {"layers": layers, "channels": _top(importance["channels"], target.hidden_size).tolist(),
            "neurons": {}, "kv_heads": {}, "q_heads": {}}
    for i in layers:
        head = importance["heads"][i]
        kv = _top(head.view(config.num_key_value_heads, group).sum(1), target.num_key_value_heads).tolist()
        q = [g * group + int(j) for g in kv for j in _top(head[g * group:(g + 1) * group], per_group).tolist()]
        plan["neurons"][i] = _top(importance["neurons"][i], target.intermediate_size).tolist()
        plan["kv_heads"][i], plan["q_heads"][i] = kv, q
    return plan


def _rows(heads: list[int], d: int) -> torch.Tensor:
    return torch.tensor([h * d + j for h in heads for j in range(d)], dtype=torch.long)


def target_config(config, target: D2DTarget):
    values = config.to_dict()
    values.update(asdict(target))
    values["head_dim"] = _head_dim(config)
    if values.get("layer_types"):
        values["layer_types"] = None  # recomputed by the config class from the new depth
    for key in ("architectures", "transformers_version", "_name_or_path"):
        values.pop(key, None)
    return type(config)(**values)


@torch.no_grad()
def prune_dense(model: nn.Module, plan: dict, target: D2DTarget) -> transformers.PreTrainedModel:
    """A fresh model of ``model``'s class with ``target``'s sizes and the weights ``plan`` keeps (no init)."""
    config = model.config
    student = build_uninitialised(target_config(config, target), next(model.parameters()).dtype)
    d = _head_dim(config)
    ch = torch.tensor(plan["channels"], dtype=torch.long)
    student.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[:, ch])
    student.model.norm.weight.copy_(model.model.norm.weight[ch])
    if not config.tie_word_embeddings:
        student.lm_head.weight.copy_(model.lm_head.weight[:, ch])
    for new, old in enumerate(plan["layers"]):
        src, dst = model.model.layers[old], student.model.layers[new]
        q, kv = _rows(plan["q_heads"][old], d), _rows(plan["kv_heads"][old], d)
        n = torch.tensor(plan["neurons"][old], dtype=torch.long)
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(dst, name).weight.copy_(getattr(src, name).weight[ch])
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            getattr(dst.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight[rows][:, ch])
            if getattr(src.self_attn, name).bias is not None:
                getattr(dst.self_attn, name).bias.copy_(getattr(src.self_attn, name).bias[rows])
        dst.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight[ch][:, q])
        if src.self_attn.o_proj.bias is not None:
            dst.self_attn.o_proj.bias.copy_(src.self_attn.o_proj.bias[ch])
        for name in ("q_norm", "k_norm"):  # per-head norms over head_dim (Qwen3): unchanged
            if hasattr(src.self_attn, name):
                getattr(dst.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
        dst.mlp.gate_proj.weight.copy_(src.mlp.gate_proj.weight[n][:, ch])
        dst.mlp.up_proj.weight.copy_(src.mlp.up_proj.weight[n][:, ch])
        dst.mlp.down_proj.weight.copy_(src.mlp.down_proj.weight[ch][:, n])
    student.moe_lab_manifest = {"method": "d2d", "target": asdict(target), "plan": plan}
    return student.eval()


def count_parameters(config, target: D2DTarget) -> int:
    """Parameters of the pruned architecture (meta device: no memory)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(target_config(config, target))
    return sum(p.numel() for p in model.parameters())


def prune_candidates(model: nn.Module, batches: list[dict], targets: dict[str, D2DTarget],
                     evaluate) -> tuple[list[dict], dict[str, dict]]:
    """Table 13's search: every candidate pruned from one importance pass (layer importance only when some
    candidate drops layers) and scored by ``evaluate(student) -> {"ppl": ..., "status": ...}``. Returns one row
    per candidate (sizes, parameters, perplexity; the caller keeps the lowest finite one) and its keep plan."""
    importance = activation_importance(model, batches)
    needs_depth = any(t.num_hidden_layers < model.config.num_hidden_layers for t in targets.values())
    layer_scores = layer_importance(model, batches) if needs_depth else None
    rows, plans = [], {}
    for name, target in targets.items():
        plans[name] = keep_plan(model.config, importance, layer_scores, target)
        student = prune_dense(model, plans[name], target)
        point = evaluate(student)
        rows.append({"candidate": name, **asdict(target), "params": sum(p.numel() for p in student.parameters()),
                     "ppl": point["ppl"], "status": point["status"]})
        del student
    return rows, plans


def best_candidate(rows: list[dict]) -> dict:
    """The row with the lowest finite perplexity (Table 13's bold choice); refuses when none is finite."""
    finite = [r for r in rows if math.isfinite(r["ppl"])]
    if not finite:
        raise ValueError(f"d2d: no candidate has a finite perplexity ({[r['status'] for r in rows]})")
    return min(finite, key=lambda r: r["ppl"])
