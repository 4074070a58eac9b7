"""Expert removal and fewer active experts (Expert Condenser's study, docs/specs/compression.md 4.1-4.2).

``prune_experts(model, calibration, keep=n', top_k=k', score=)`` keeps, in every MoE layer, the n' experts
with the highest score (ties -> lower id; ``always_keep`` experts, e.g. a condenser run's condensers, first),
slices the packed expert tensors, router rows, router bias and selection-only correction bias to them (in
original order), sets the config's expert count to n' and ``num_experts_per_tok`` to k', and rebuilds the
model from that config: the result is a vanilla HF model (the family's own class). Weighting after pruning
is the family's own rule on the sliced router (softmax over the n' surviving logits, spec A0-2).

Strategies: Small Dense (n' = k'), Small MoE (k' = k < n'), Inference Reduce (n' = n, k' < k).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
import transformers
from torch import nn

from ..core.precision import load_dtype
from ..models import validate_config
from ..moe.registry import family_spec, routing_size_paths, update_config_dict
from ..moe.view import MoELayerView, find_moe_layers
from .calibration import Calibration
from .dense import build_uninitialised, canonical
from .grouping import rank
from .scores import scores as expert_scores

STRATEGIES = ("small_dense", "small_moe", "inference_reduce")
CONDENSER_FILE = "condenser.json"


def strategy_counts(strategy: str, num_experts: int, top_k: int, n_keep: int | None = None,
                    k_keep: int | None = None) -> tuple[int, int]:
    """``(n', k')`` of a named strategy: small_dense (n_keep, n_keep), small_moe (n_keep, k),
    inference_reduce (n, k_keep)."""
    if strategy == "small_dense":
        return _need(n_keep, "prune.n_keep", strategy), _need(n_keep, "prune.n_keep", strategy)
    if strategy == "small_moe":
        return _need(n_keep, "prune.n_keep", strategy), top_k
    if strategy == "inference_reduce":
        return num_experts, _need(k_keep, "prune.top_k", strategy)
    raise ValueError(f"prune.strategy={strategy!r}: choose one of {', '.join(STRATEGIES)}")


def _need(value, field, strategy):
    if value is None:
        raise ValueError(f"prune.strategy={strategy} needs {field}")
    return int(value)


def condensers_from_export(path) -> dict[int, list[int]]:
    """``{layer: condenser expert ids}`` from a condenser export directory (or its ``condenser.json``)."""
    path = Path(path)
    if path.is_dir():
        path = path / CONDENSER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: always_keep= takes a condenser export directory "
                                "(with condenser.json), the json file itself, or {layer: [expert ids]}")
    state = json.loads(path.read_text())
    return {int(i): [int(e) for e in layer.get("forced_experts", [])] for i, layer in state["layers"].items()}


def kept_experts(view: MoELayerView, score: torch.Tensor, keep: int, always: list[int],
                 group_balanced: bool = False) -> list[int]:
    """The ``keep`` experts of one layer (sorted ids): ``always`` first, then by descending score; with
    ``group_balanced`` the best keep/n_group of every routing group."""
    always = sorted({int(e) for e in always})
    if len(always) > keep:
        raise ValueError(f"layer {view.index}: always_keep has {len(always)} experts {always} but keep={keep}: "
                         f"raise keep to at least {len(always)}")
    rule, E = view.rule, view.num_experts
    if group_balanced and rule.n_group:
        if keep % rule.n_group:
            raise ValueError(f"keep={keep} is not divisible by n_group={rule.n_group}: group-balanced pruning keeps "
                             "the same number of experts in every routing group")
        size, per = E // rule.n_group, keep // rule.n_group
        kept = []
        for g in range(rule.n_group):
            members = list(range(g * size, (g + 1) * size))
            fixed = [e for e in always if e in members]
            if len(fixed) > per:
                raise ValueError(f"layer {view.index}: always_keep puts {len(fixed)} experts in routing group {g} "
                                 f"but group-balanced pruning keeps {per} per group: raise keep")
            kept += fixed + [e for e in rank(score, members) if e not in fixed][: per - len(fixed)]
        return sorted(kept)
    ranked = [e for e in rank(score) if e not in always]
    return sorted(always + ranked[: keep - len(always)])


def _check_groups(view: MoELayerView, kept: list[int], top_k: int) -> None:
    rule = view.rule
    if not rule.n_group:
        return
    size = view.num_experts // rule.n_group
    per_group = [sum(1 for e in kept if e // size == g) for g in range(rule.n_group)]
    if len(set(per_group)) != 1:
        raise ValueError(
            f"layer {view.index}: group-limited routing (n_group={rule.n_group}, topk_group={rule.topk_group}) "
            f"needs the same number of experts kept in every group, but the kept experts fall {per_group} per "
            "group: pass group_balanced=True (prune.group_balanced=true), or switch the model to plain top-k "
            "(DeepSeek-V2: topk_method=greedy)"
        )
    reachable = rule.topk_group * per_group[0]
    if top_k > reachable or (rule.group_score == "top2_sum" and per_group[0] < 2):
        raise ValueError(f"layer {view.index}: top_k={top_k} with {per_group[0]} experts per group and "
                         f"topk_group={rule.topk_group} leaves {reachable} reachable experts (top-2 group scores "
                         "need >= 2 per group): keep more experts or lower top_k")


def pruned_config(config, keep: int, top_k: int):
    """A copy of ``config`` with the expert count ``keep`` and ``num_experts_per_tok = top_k``, validated."""
    values = config.to_dict()
    count, k = routing_size_paths(family_spec(config.model_type), config)
    update_config_dict(values, canonical(config, {count: keep, k: top_k}))
    for key in ("model_type", "architectures", "transformers_version", "_name_or_path"):
        values.pop(key, None)
    new = type(config)(**values)
    validate_config(new)
    return new


@torch.no_grad()
def prune_experts(model: nn.Module, calibration: Calibration | None = None, keep: int | None = None,
                  top_k: int | None = None, score: str = "es_act", *,
                  always_keep: Mapping[int, list[int]] | str | Path | None = None, group_balanced: bool = False,
                  seed: int = 0, variant: str = "gated") -> transformers.PreTrainedModel:
    """A new vanilla HF model with ``keep`` (n') experts per MoE layer and top-``top_k`` (k') routing.

    keep: default all experts; top_k: default the model's k (must satisfy k' <= n'). score: any
    ``moe_lab.compress.scores`` method (es_act default; needs ``calibration`` unless keep = n). always_keep:
    {layer: ids}, or a condenser export directory / condenser.json (its condensers are always kept).
    ``model.moe_lab_manifest`` records the kept experts per layer.
    """
    views = find_moe_layers(model)
    E, k = views[0].num_experts, views[0].top_k
    keep = E if keep is None else int(keep)
    top_k = k if top_k is None else int(top_k)
    if not 1 <= keep <= E:
        raise ValueError(f"keep={keep} (prune.n_keep) must be between 1 and num_experts={E}")
    if not 1 <= top_k <= keep:
        raise ValueError(f"top_k={top_k} (k', prune.top_k) must be between 1 and keep={keep} (n'): a token cannot "
                         f"select more experts than remain; lower top_k or raise keep")
    fixed = views[0].spec.vanilla_top_k
    if fixed is not None and top_k != fixed:
        raise ValueError(f"top_k={top_k}: vanilla HF {model.config.model_type} always routes {fixed} experts "
                         f"(num_experts_per_tok is ignored), so a k'={top_k} checkpoint would not load as such: "
                         f"keep top_k={fixed}")
    if always_keep is not None and not isinstance(always_keep, Mapping):
        always_keep = condensers_from_export(always_keep)
    always_keep = {int(i): list(v) for i, v in (always_keep or {}).items()}
    if keep < E:
        if calibration is None:
            raise ValueError(f"keep={keep} < num_experts={E} needs a calibration file to score experts by {score!r}")
        calibration.check_compatible(model)
        values = expert_scores(calibration, score, seed=seed, variant=variant)
    kept = {}
    for view in views:
        if keep == E:
            kept[view.index] = list(range(E))
        else:
            kept[view.index] = kept_experts(view, values[view.index], keep, always_keep.get(view.index, []),
                                            group_balanced)
        _check_groups(view, kept[view.index], top_k)
    config = pruned_config(model.config, keep, top_k)
    pruned = build_uninitialised(config, load_dtype(model)).to(next(model.parameters()).device).eval()
    sliced = _sliced_state(model, views, kept)
    missing, unexpected = pruned.load_state_dict(sliced, strict=False)
    if missing or unexpected:  # every tensor must come from the model (the new one is uninitialised)
        raise ValueError(f"pruned model does not match the sliced weights (missing {missing}, unexpected "
                         f"{unexpected})")
    pruned.moe_lab_manifest = {"method": "prune", "score": score, "keep": keep, "top_k": top_k,
                               "group_balanced": group_balanced, "always_keep": always_keep,
                               "layers": {str(i): ids for i, ids in kept.items()},
                               "calibration": None if calibration is None else calibration.manifest.get("data")}
    return pruned


def _sliced_state(model: nn.Module, views: list[MoELayerView], kept: dict[int, list[int]]) -> dict:
    """The model's state dict with every per-expert tensor (packed experts, router rows, router bias,
    correction bias) of each MoE layer restricted to its kept experts."""
    state = model.state_dict()
    for view in views:
        idx = torch.tensor(kept[view.index], dtype=torch.long)
        own = view.spec.correction_bias_attr
        for prefix in (f"{view.name}.experts.", f"{view.name}.{view.spec.router_attr}.",
                       *([f"{view.name}.{own}"] if own else [])):
            for name in [n for n in state if n.startswith(prefix)]:
                dim = -1 if own and name == f"{view.name}.{own}" else 0  # ERNIE's bias is [1, E]
                tensor = state[name]
                if prefix.endswith(".experts.") and tensor.dim() and tensor.shape[0] % view.num_experts == 0:
                    # expert tensors: the expert is the leading axis in E equal blocks (one index when packed,
                    # I rows of DBRX's [E*I, H]; moe_lab.moe.layout)
                    blocks = tensor.reshape(view.num_experts, -1).index_select(0, idx.to(tensor.device))
                    state[name] = blocks.reshape(-1, *tensor.shape[1:])
                elif tensor.dim() and tensor.shape[dim] == view.num_experts:
                    state[name] = tensor.index_select(dim, idx.to(tensor.device))
    return state
