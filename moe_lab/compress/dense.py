"""MoE -> dense conversion (spec compression.md 2.1-2.8): per MoE layer select K experts by a score, group
them into k groups, merge each group by score-weighted averaging, scale the down projections and concatenate
the k representatives (shared experts first, unscaled) into one dense FFN; write it into the vanilla HF
architecture named by the family registry (``FamilySpec.dense_target``).

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

from ..methods.precision import config_in_load_dtype, in_load_dtype, load_dtype
from ..moe.experts import expert_intermediate_size
from ..moe.patch import atomic_export
from ..moe.view import MoELayerView, dense_layer_indices, find_moe_layers
from .calibration import Calibration
from .grouping import GROUPINGS, clustering_distance, group_experts, rank
from .merge import SCALINGS, check_scaling, merge_coefficients, merge_group, scaling_coefficients
from .scores import DOPT_METHODS, select_experts
from .scores import scores as expert_scores

MLP_PROJ = ("gate_proj", "up_proj", "down_proj")  # the HF gated-MLP convention of every dense target
MANIFEST_FILE = "compress_manifest.json"
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
                               expert_features=(view.gate_up_proj, view.down_proj), gram=stats.get("gram"))


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
    alpha = scaling_coefficients(scaling, groups, score, k, cp=cp, routed_scaling=view.rule.scaling)
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
    check_scaling(scaling, views[0].rule.normalises_topk, views[0].rule.scaling)
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
    """One packed expert (no expert dim) whose output is ``sum_g alpha_g f_g(x)``: the representatives'
    blocks concatenated along the intermediate axis, down projections (GPT-OSS: and down biases) scaled."""
    a = [float(x) for x in alpha]

    def scaled(t, g):
        return (t.double() * a[g]).to(t.dtype)

    if view.spec.expert_layout == "gpt_oss":  # gate_up [H, 2I] interleaved, down [I, H], biases
        return {
            "gate_up_proj": torch.cat([r["gate_up_proj"] for r in reps], dim=1),
            "gate_up_proj_bias": torch.cat([r["gate_up_proj_bias"] for r in reps]),
            "down_proj": torch.cat([scaled(r["down_proj"], g) for g, r in enumerate(reps)], dim=0),
            "down_proj_bias": sum(r["down_proj_bias"].double() * a[g] for g, r in enumerate(reps))
            .to(reps[0]["down_proj_bias"].dtype),
        }
    gates, ups = zip(*(r["gate_up_proj"].chunk(2, dim=0) for r in reps))  # [2I, H]: gate rows, then up rows
    return {
        "gate_up_proj": torch.cat(list(gates) + list(ups), dim=0),
        "down_proj": torch.cat([scaled(r["down_proj"], g) for g, r in enumerate(reps)], dim=1),
    }


def layer_ffn(view: MoELayerView, layer_plan: LayerPlan) -> dict[str, torch.Tensor]:
    """The merged, scaled, concatenated routed part of one layer (one packed expert)."""
    params = view.expert_parameters()
    reps = [merge_group(params, g, c) for g, c in zip(layer_plan.groups, layer_plan.coefficients)]
    return concat_experts(view, reps, layer_plan.alpha)


def _shared_width(view: MoELayerView) -> int:
    return 0 if view.shared is None else view.shared.gate_proj.weight.shape[0]


def dense_width(views: list[MoELayerView]) -> int:
    """Width of the student's FFN: k*I (+ the shared experts' width where they are concatenated in)."""
    view = views[0]
    target = _target(view)
    routed = view.top_k * expert_intermediate_size(view)
    return routed + (_shared_width(view) if target.form == "mlp" else 0)


def _target(view: MoELayerView):
    target = view.spec.dense_target
    if target is None:
        raise ValueError(
            f"model_type {view.spec.model_type!r} has no vanilla dense target (FamilySpec.dense_target is None: "
            f"{view.spec.notes or 'no dense HF class reproduces its blocks'}); convert another family or add a "
            "DenseTarget for it in moe_lab/moe/registry.py"
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
    values.update(canonical(config, target.overrides(config, width)))
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

    from ..models import keep_hf_fp32

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

    def _ffn_prefixes(self) -> list[str]:
        if self.target.form == "mlp":
            return [v.name + "." for v in self.views]
        return [f"{v.name}.{part}." for v in self.views for part in ("experts", v.spec.router_attr)]

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
            ffn = layer_ffn(view, plans[view.index])
            module = self.student.get_submodule(view.name)
            if self.target.form == "mlp":
                self._write_mlp(module, view, ffn)
            else:
                for name, tensor in ffn.items():
                    getattr(module.experts, name)[0].copy_(tensor)
                router = getattr(module, view.spec.router_attr)
                for p in router.parameters():
                    p.zero_()
        self.student.moe_lab_manifest = {"layers": {i: p.to_json() for i, p in plans.items()}}
        return self.student

    def _write_mlp(self, module: nn.Module, view: MoELayerView, ffn: dict) -> None:
        gate, up = ffn["gate_up_proj"].chunk(2, dim=0)
        down = ffn["down_proj"]
        if view.shared is not None:
            shared = view.shared
            gate = torch.cat([shared.gate_proj.weight, gate])
            up = torch.cat([shared.up_proj.weight, up])
            down = torch.cat([shared.down_proj.weight, down], dim=1)
        for name, tensor in zip(MLP_PROJ, (gate, up, down)):
            getattr(module, name).weight.copy_(tensor)


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
    routed_scaling = float(builder.views[0].rule.scaling)
    if scaling != "conditional" and routed_scaling != 1.0:
        log.info("compress.scaling=%s scaled by the router's routed_scaling_factor=%g: the alphas sum to the "
                 "routed mass %g, not 1", scaling, routed_scaling, routed_scaling)
    knobs = {"score": score, "grouping": grouping, "scaling": scaling, "K": K or builder.views[0].top_k,
             "order": order, "lam": lam, "seed": seed, "routed_scaling": routed_scaling}
    student.moe_lab_manifest = manifest(calibration, knobs, plans)
    return student


def manifest(calibration: Calibration, knobs: dict, plans: dict[int, LayerPlan]) -> dict:
    """The conversion manifest: method, knobs, calibration identity, per-layer plan (spec 5.2)."""
    m = calibration.manifest
    return {"method": "moe_to_dense", **knobs,
            "calibration": {"model": m.get("model"), "data": m.get("data"), "tokens": m.get("tokens")},
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
