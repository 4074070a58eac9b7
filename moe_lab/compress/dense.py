"""MoE -> dense conversion (docs/specs/compression.md 2.1-2.8): per MoE layer select K experts by a score, group
them into k groups, merge each group by score-weighted averaging, scale the down projections and concatenate
the k representatives (shared experts first, unscaled) into one dense FFN; write it into the vanilla HF
architecture named by the family registry (``FamilySpec.dense_target``).

Sigmoid routers (DeepSeek-V3 line, GLM-4.5, dots, Kimi, MiniMax-M2, ...): [P2] covers softmax routers only
(Qwen3, GPT-OSS, DeepSeek-V2-Lite). Its probability p is read as the family's per-expert score, the sigmoid
affinity (spec 2.2; manifest ``calibration.p_definition = sigmoid_scores``), and the alphas keep the routed mass:
uniform / proportional sum to the block's routed scaling (routed_scaling_factor, times an output scaling where
the block applies one: :func:`routed_mass`), the mass a renormalising router applies; ``conditional`` (routed
scaling x mean CP, CP = the mean affinity when selected, i.e. the weight a non-renormalising sigmoid router
applies on average) is for routers that do not renormalise, as for softmax.

Targets (``DenseTarget.form``): ``mlp`` (a dense class), ``one_expert`` / ``k_experts`` (the family's own class
with one expert of width k*I, or the k representatives, all selected by a zeroed router; the down projections are
divided by the constant weight that router applies, :func:`routed_weight`).

``to_dense(model, calibration, score=, grouping=, scaling=, K=)`` returns the student;
``export_compressed(student, path, tokenizer)`` writes save_pretrained + tokenizer + ``compress_manifest.json``.
:class:`DenseBuilder` keeps one student skeleton and rewrites only its FFNs (used by sweeps).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn

from ..core.export_check import MANIFEST_FILE
from ..core.precision import config_in_load_dtype, in_load_dtype, keep_hf_fp32, load_dtype
from ..moe.experts import expert_intermediate_size
from ..moe.patch import atomic_export
from ..moe.registry import update_config_dict
from ..moe.routing import select_topk
from ..moe.support import undefined_reason
from ..moe.view import MoELayerView, dense_layer_indices, find_moe_layers
from .calibration import Calibration
from .grouping import GROUPINGS, clustering_distance, group_experts, rank
from .merge import SCALINGS, check_scaling, merge_coefficients, merge_group, scaling_coefficients
from .scores import DOPT_METHODS, select_experts
from .scores import scores as expert_scores

# the HF gated-MLP naming conventions (gate, up, down) of the dense targets' MLPs: Llama-style, LFM2-style
MLP_PROJS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
log = logging.getLogger(__name__)


@dataclass
class LayerPlan:
    """What one MoE layer becomes: ranked selected experts, groups, merge coefficients, alpha per group."""

    layer: int
    selected: list[int]
    groups: list[list[int]]
    coefficients: list[torch.Tensor]
    alpha: torch.Tensor

    def to_json(self) -> dict:
        return {"selected": self.selected, "groups": self.groups,
                "coefficients": [c.tolist() for c in self.coefficients], "alpha": self.alpha.tolist()}


def check_K(K: int, k: int, E: int) -> None:
    """K must lie in [k, E]: k groups need at least k experts."""
    if not k <= int(K) <= E:
        raise ValueError(f"compress.K={K} must be between the router's top_k={k} (one expert per group) and "
                         f"num_experts={E}: set compress.K in [{k}, {E}]")


def check_choice(field: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"compress.{field}={value!r}: choose one of {', '.join(allowed)}")


def layer_distance(view: MoELayerView, stats: dict, grouping: str) -> torch.Tensor:
    """The [E, E] clustering distance of ``grouping`` (wc: expert weights without biases; rc: router rows;
    oc: calibration Gram) for one layer."""
    return clustering_distance(grouping, router_weight=view.router_weight,
                               expert_features=tuple(view.expert_parameters()[n] for n in view.layout.names),
                               gram=stats.get("gram"))


def routed_mass(view: MoELayerView) -> float:
    """The factor the block applies to its routed mixture beyond the top-k weights' normalisation: the router's
    routed scaling times the block's output scaling (registry ``output_scaling_field``: Beam, Laguna, MiniMax-M3).
    A renormalising router's weights sum to it; uniform / proportional alphas are scaled to sum to it."""
    scale = float(view.rule.scaling)
    if view.spec.output_scaling_field:
        scale *= float(getattr(view.config, view.spec.output_scaling_field))
    return scale


def plan_layer(view: MoELayerView, stats: dict, score: torch.Tensor, ranked: list[int], grouping: str,
               scaling: str, cp: torch.Tensor | None = None, distances: dict | None = None) -> LayerPlan:
    """Group the ranked selected experts of one layer, merge coefficients and alphas (spec 2.5-2.7).
    ``distances``: a dict memoising the per-layer clustering distances across calls (sweeps)."""
    k = view.top_k
    distance = None
    if grouping in ("wc", "rc", "oc"):
        distances = {} if distances is None else distances
        key = (view.index, grouping)
        if key not in distances:
            distances[key] = layer_distance(view, stats, grouping)
        distance = distances[key]
    groups = group_experts(grouping, ranked, k, router_weight=view.router_weight.detach(), distance=distance)
    coefficients = [merge_coefficients(score, g) for g in groups]
    alpha = scaling_coefficients(scaling, groups, score, k, cp=cp, routed_scaling=routed_mass(view))
    return LayerPlan(view.index, list(ranked), groups, coefficients, alpha)


def plan(model: nn.Module, calibration: Calibration, *, score: str = "do_acp", grouping: str = "rr",
         scaling: str = "uniform", K: int | None = None, order: str = "score", lam="auto", seed: int = 0,
         selection: dict | None = None, score_values: dict | None = None,
         distances: dict | None = None) -> dict[int, LayerPlan]:
    """A :class:`LayerPlan` per MoE layer. ``order``: ``score`` ranks the selected experts by score (the DO
    methods by their base importance), ``greedy`` keeps the D-optimal addition order. ``selection`` /
    ``score_values`` pass precomputed ``select_experts`` / ``scores`` results, ``distances`` a dict that keeps
    the clustering distances between calls (sweeps)."""
    views = find_moe_layers(model)
    k, E = views[0].top_k, views[0].num_experts
    K = k if K is None else int(K)
    check_K(K, k, E)
    check_choice("grouping", grouping, GROUPINGS)
    check_choice("scaling", scaling, SCALINGS)
    check_scaling(scaling, views[0].rule.normalises_topk, routed_mass(views[0]))
    check_choice("order", order, ("score", "greedy"))
    if score_values is None:
        score_values = expert_scores(calibration, score, seed=seed)
    if selection is None:
        selection = select_experts(calibration, score, K, lam=lam, seed=seed)
    cp = expert_scores(calibration, "cp") if scaling == "conditional" else {}
    plans = {}
    for view in views:
        s = score_values[view.index]
        chosen = [int(e) for e in selection[view.index]]
        ranked = chosen if (order == "greedy" and score in DOPT_METHODS) else rank(s, chosen)
        plans[view.index] = plan_layer(view, calibration.layers[view.index], s, ranked, grouping, scaling,
                                       cp.get(view.index), distances)
    return plans


def concat_experts(view: MoELayerView, reps: list[dict], alpha: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert (no expert dim) whose output is ``sum_g alpha_g f_g(x)``: the representatives' blocks
    concatenated along the layout's intermediate axis (``moe_lab.moe.layout``), down projections (GPT-OSS: and
    down biases) scaled."""
    a = [float(x) for x in alpha]

    def scaled(t, g):
        return (t.double() * a[g]).to(t.dtype)

    layout = view.layout
    if not layout.packed:  # row blocks (DBRX's w1 / v1 / w2 [I, H]): rows are the intermediate axis
        return {name: torch.cat([scaled(r[name], g) if name in layout.down else r[name]
                                 for g, r in enumerate(reps)]) for name in reps[0]}
    axis = 1 if layout.transposed else 0  # the intermediate axis of one expert's gate_up ([H, 2I] or [2I, H])

    def gate_up(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
        if layout.interleaved:  # GPT-OSS: (gate, up) column pairs stay adjacent
            return torch.cat(tensors, dim=dim)
        gates, ups = zip(*(t.chunk(2, dim=dim) for t in tensors))  # gate rows / columns, then up
        return torch.cat(gates + ups, dim=dim)

    out = {"gate_up_proj": gate_up([r["gate_up_proj"] for r in reps], axis),
           "down_proj": torch.cat([scaled(r["down_proj"], g) for g, r in enumerate(reps)], dim=1 - axis)}
    if layout.biases:  # GPT-OSS: the gate_up biases concatenated, the down biases summed scaled
        out["gate_up_proj_bias"] = gate_up([r["gate_up_proj_bias"] for r in reps], 0)
        out["down_proj_bias"] = sum(r["down_proj_bias"].double() * a[g] for g, r in enumerate(reps)).to(
            reps[0]["down_proj_bias"].dtype)
    return out


def representatives(view: MoELayerView, layer_plan: LayerPlan) -> list[dict[str, torch.Tensor]]:
    """The k merged representatives of one layer (one packed expert each, unscaled)."""
    params = view.expert_parameters()
    return [merge_group(params, g, c) for g, c in zip(layer_plan.groups, layer_plan.coefficients)]


def _folded(alpha: torch.Tensor, fold: float) -> torch.Tensor:
    return alpha if fold == 1.0 else alpha.double() / fold


def layer_ffn(view: MoELayerView, layer_plan: LayerPlan, fold: float = 1.0) -> dict[str, torch.Tensor]:
    """The merged, scaled, concatenated routed part of one layer (one packed expert); the down projections are
    scaled by alpha / ``fold`` (``fold``: the factor a one-expert target's block applies to its one expert)."""
    return concat_experts(view, representatives(view, layer_plan), _folded(layer_plan.alpha, fold))


def scaled_experts(view: MoELayerView, layer_plan: LayerPlan, fold: float) -> dict[str, torch.Tensor]:
    """The k representatives packed as k experts ([k, ...] each tensor), representative g's down projection (and
    down bias) scaled by alpha_g / ``fold``: the routed part of a ``k_experts`` target."""
    alpha = [float(a) for a in _folded(layer_plan.alpha, fold)]
    reps = representatives(view, layer_plan)
    down = view.layout.down
    return {name: torch.stack([(r[name].double() * a).to(r[name].dtype) if name in down else r[name]
                               for r, a in zip(reps, alpha)]) for name in reps[0]}


def _shared_width(view: MoELayerView) -> int:
    return 0 if view.shared is None else mlp_projections(view.shared)[0].weight.shape[0]


def dense_width(views: list[MoELayerView]) -> int:
    """Width of the student's FFN: k*I (+ the shared experts' width where they are concatenated in); the width
    of one expert for a ``k_experts`` target."""
    view = views[0]
    target = _target(view)
    routed = view.top_k * expert_intermediate_size(view)
    if target.form == "k_experts":  # k experts of the teacher's width
        return expert_intermediate_size(view)
    return routed + (_shared_width(view) if target.form == "mlp" else 0)


def _target(view: MoELayerView):
    target = view.spec.dense_target
    if target is None:
        raise ValueError(
            f"model_type {view.spec.model_type!r} has no vanilla dense target (FamilySpec.dense_target is None: "
            f"{undefined_reason('to_dense', view.spec, view.rule)}); convert another family or add a DenseTarget "
            "for it in moe_lab/moe/registry.py"
        )
    if target.form == "mlp" and view.spec.shared_gate_attr is not None:
        raise ValueError(f"{view.spec.model_type}: a gated shared expert cannot be folded into a plain MLP target")
    return target


def target_config(config, width: int):
    """The HF config of the dense student (the family's ``dense_target``)."""
    from ..moe.registry import family_spec

    target = family_spec(config.model_type).dense_target
    values = config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "_name_or_path"):
        values.pop(key, None)
    if target.config_class:
        cls = getattr(transformers, target.config_class)
        known = set(cls().to_dict())
        values = {k: v for k, v in values.items() if k in known}
    else:
        cls = type(config)
    update_config_dict(values, canonical(config, target.overrides(config, width)))
    return cls(**values)


def canonical(config, fields: dict) -> dict:
    """``fields`` with aliased names (``config.attribute_map``, e.g. num_experts -> num_local_experts) resolved
    to the names ``config.to_dict()`` uses, so that they override its values."""
    aliases = getattr(config, "attribute_map", {}) or {}
    return {aliases.get(k, k): v for k, v in fields.items()}


def build_uninitialised(config, dtype: torch.dtype) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` without random initialisation (every tensor is overwritten by the
    caller; non-persistent buffers such as rotary frequencies are still computed), in ``dtype`` (its load
    dtype, ``config.dtype``) but for the tensors HF keeps in fp32 (``keep_hf_fp32``), as from_pretrained."""
    from transformers.initialization import no_init_weights

    with torch.random.fork_rng(devices=[]), no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    keep_hf_fp32(model, dtype)
    return model


def _sibling(path: str, layer: int) -> str:
    return re.sub(r"layers\.\d+\.", f"layers.{layer}.", path, count=1)


def _pad_copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if any(s > d for s, d in zip(src.shape, dst.shape)):
        raise ValueError(f"teacher dense layer {name} {tuple(src.shape)} is wider than the student's FFN "
                         f"{tuple(dst.shape)}: a single-width dense target is impossible for this model")
    dst.zero_()
    dst[tuple(slice(0, s) for s in src.shape)].copy_(src)


class DenseBuilder:
    """One dense student of ``teacher`` (skeleton built once); :meth:`write` fills its FFNs from plans."""

    def __init__(self, teacher: nn.Module):
        self.teacher = teacher
        self.views = find_moe_layers(teacher)
        view = self.views[0]
        self.target = _target(view)
        self.width = dense_width(self.views)
        config = target_config(teacher.config, self.width)
        student = build_uninitialised(config, load_dtype(teacher))  # a bf16-loaded teacher: a bf16 student
        self.student = student.to(next(teacher.parameters()).device).eval()
        self._copy_backbone()
        self.student_views = {v.index: v for v in find_moe_layers(self.student)} if self.target.form != "mlp" else {}
        self.fold = 1.0 if self.target.form == "mlp" else routed_weight(self.student)

    def _ffn_prefixes(self) -> list[str]:
        if self.target.form == "mlp":
            return [v.name + "." for v in self.views]
        spec = self.views[0].spec
        parts = ["experts.", spec.router_attr + "."] + ([spec.correction_bias_attr] if spec.correction_bias_attr else [])
        return [f"{v.name}.{part}" for v in self.views for part in parts]  # + a block-held selection bias

    @torch.no_grad()
    def _copy_backbone(self) -> None:
        """Copy every non-FFN tensor bit-identically; pad the teacher's dense layers (mlp form)."""
        source = self.teacher.state_dict()
        prefixes = self._ffn_prefixes()
        dense = {_sibling(self.views[0].name, i) + "." for i in dense_layer_indices(self.teacher, self.views)}
        for name, tensor in self.student.state_dict().items():
            if any(name.startswith(p) for p in prefixes):
                tensor.zero_()  # written by write(); never left uninitialised
                continue
            src = source.get(name)
            if src is not None and src.shape == tensor.shape:
                tensor.copy_(src)
            elif src is not None and any(name.startswith(p) for p in dense):
                _pad_copy(tensor, src, name)
            else:
                raise ValueError(f"dense student tensor {name} {tuple(tensor.shape)} has no teacher counterpart "
                                 f"({None if src is None else tuple(src.shape)}): the dense_target config of "
                                 f"{self.teacher.config.model_type} does not match its architecture")

    @torch.no_grad()
    def write(self, plans: dict[int, LayerPlan]) -> nn.Module:
        """Rewrite every student FFN from ``plans`` (one per MoE layer); returns the student."""
        for view in self.views:
            module = self.student.get_submodule(view.name)
            if self.target.form == "mlp":
                self._write_mlp(module, view, layer_ffn(view, plans[view.index]))
            else:
                packed = (scaled_experts(view, plans[view.index], self.fold) if self.target.form == "k_experts"
                          else {n: t[None] for n, t in layer_ffn(view, plans[view.index], self.fold).items()})
                targets = self.student_views[view.index].expert_parameters()  # [E', ...] views of its tensors
                for name, tensor in packed.items():
                    targets[name].copy_(tensor)
                router = getattr(module, view.spec.router_attr)
                for p in router.parameters():
                    p.zero_()
        self.student.moe_lab_manifest = {"layers": {i: p.to_json() for i, p in plans.items()}}
        return self.student

    def _write_mlp(self, module: nn.Module, view: MoELayerView, ffn: dict) -> None:
        gate, up = ffn["gate_up_proj"].chunk(2, dim=0)
        down = ffn["down_proj"]
        if view.shared is not None:
            s_gate, s_up, s_down = (p.weight for p in mlp_projections(view.shared))
            gate, up, down = torch.cat([s_gate, gate]), torch.cat([s_up, up]), torch.cat([s_down, down], dim=1)
        for proj, tensor in zip(mlp_projections(module), (gate, up, down)):
            proj.weight.copy_(tensor)


def mlp_projections(module: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The (gate, up, down) Linears of a gated MLP, under any of the HF naming conventions ``MLP_PROJS``."""
    for names in MLP_PROJS:
        if all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
            return tuple(getattr(module, n) for n in names)
    raise ValueError(f"{type(module).__name__} is not a gated MLP with separate Linears named "
                     f"{' or '.join('/'.join(n) for n in MLP_PROJS)}: not a dense-target MLP")


@torch.no_grad()
def routed_weight(student: nn.Module) -> float:
    """The factor a routed (one_expert / k_experts) student's block applies to each of its experts' outputs: the
    weight its routing rule gives every expert when all logits (router zeroed) and selection biases are 0 and
    top_k = num_experts selects them all (softmax / renormalised: routed scaling / E'; a sigmoid router that does
    not renormalise: sigmoid(0) = 0.5 times it), times the block's output scaling. The routed down projections are
    divided by it, so that the block applies exactly alpha."""
    view = find_moe_layers(student)[0]
    rule = view.rule
    if rule.top_k != rule.num_experts:
        raise ValueError(f"{student.config.model_type}: a routed dense target must select all of its experts, got "
                         f"num_experts={rule.num_experts}, top_k={rule.top_k}")
    zero = torch.zeros(1, rule.num_experts)
    weights, _ = select_topk(rule, zero, False, correction_bias=zero[0] if rule.uses_correction_bias else None)
    if not torch.all(weights == weights[0, 0]):
        raise ValueError(f"{student.config.model_type}: the routed dense target weighs its experts unequally "
                         f"({weights.tolist()}) with a zero router")
    return float(weights[0, 0]) * routed_mass(view) / float(rule.scaling)


def to_dense(model: nn.Module, calibration: Calibration, score: str = "do_acp", grouping: str = "rr",
             scaling: str = "uniform", K: int | None = None, *, order: str = "score", lam="auto",
             seed: int = 0) -> transformers.PreTrainedModel:
    """The dense student of ``model`` (spec 2.1 steps 1-6), a vanilla HF model (``FamilySpec.dense_target``).

    score: sf | pp | ps | cp | acp | do_cp | do_acp | reap | ean_mean (ean) | ean_sum | es_act | es_mag | random; grouping:
    rr | wc | rc | ab | oc; scaling: uniform | proportional | conditional; K in [top_k, num_experts]
    (default top_k, pure pruning). The plan per layer is in ``student.moe_lab_manifest``.
    """
    calibration.check_compatible(model)
    plans = plan(model, calibration, score=score, grouping=grouping, scaling=scaling, K=K, order=order,
                 lam=lam, seed=seed)
    builder = DenseBuilder(model)
    student = builder.write(plans)
    routed_scaling = routed_mass(builder.views[0])
    if scaling != "conditional" and routed_scaling != 1.0:
        log.info("compress.scaling=%s scaled by the block's routed scaling %g: the alphas sum to the routed mass "
                 "%g, not 1", scaling, routed_scaling, routed_scaling)
    knobs = {"score": score, "grouping": grouping, "scaling": scaling, "K": K or builder.views[0].top_k,
             "order": order, "lam": lam, "seed": seed, "routed_scaling": routed_scaling}
    student.moe_lab_manifest = manifest(calibration, knobs, plans)
    return student


def manifest(calibration: Calibration, knobs: dict, plans: dict[int, LayerPlan]) -> dict:
    """The conversion manifest: method, knobs, calibration identity, per-layer plan (spec 5.2)."""
    m = calibration.manifest
    return {"method": "moe_to_dense", **knobs,
            "calibration": {"model": m.get("model"), "data": m.get("data"), "tokens": m.get("tokens"),
                            "p_definition": m.get("p_definition")},
            "layers": {str(i): p.to_json() for i, p in plans.items()}}


def export_compressed(student: nn.Module, path, tokenizer=None, state_dict: dict | None = None) -> Path:
    """save_pretrained (of ``state_dict`` when given) + tokenizer + the compression manifest
    (``compress_manifest.json``) of a converted or pruned model; the directory loads with vanilla
    AutoModelForCausalLM. Every tensor is written in the model's load dtype (``precision.in_load_dtype``: the
    dtype the compressed model was built in, the source model's), and ``config.json`` says so. Written
    atomically (:func:`~moe_lab.moe.patch.atomic_export`): a kill never leaves weights without their manifest."""
    def write(tmp: Path) -> None:
        state = in_load_dtype(student, student.state_dict() if state_dict is None else state_dict)
        student.save_pretrained(tmp, state_dict=state)
        config_in_load_dtype(student, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        info = getattr(student, "moe_lab_manifest", None)
        if info is not None:
            (tmp / MANIFEST_FILE).write_text(json.dumps(info, indent=1))

    return atomic_export(path, write)
