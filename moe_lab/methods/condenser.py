"""Expert Condenser: a per-layer router bias that sparsifies (or balances) expert load, plus condenser
experts that every token uses.

Per MoE layer: an fp32 bias ``b`` [E] (buffer ``bias``, saved in checkpoints) enters selection only
(``bias_mode="selection"``: weights from the unbiased scores) or the logits (``bias_mode="logit"``).
After every optimizer step, :class:`BiasUpdater` applies ``b += gamma * sign * sign(mean_load - load)``
from the integer loads since the previous update, all-reduced across data-parallel ranks
(``sign``: sparsify = -1, balance = +1), optionally re-centred to zero mean. After ``warmup_steps``
updates (or at once, from ``experts=`` or a saved ``bias_file``) ``n`` condenser experts per layer are
chosen by ``select`` and forced into every token's active set, gated by their router weight:
``budget="replace"`` keeps |S| = k (top-(k-n) + n condensers), ``"append"`` uses k + n.
Condenser biases are frozen once chosen; the others keep updating over the non-condenser experts.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from ..moe.block import ConventionalRouting, MoEBlock
from ..moe.patch import MoEPatch
from ..moe.routing import select_topk

log = logging.getLogger(__name__)

SIGNS = {"sparsify": -1.0, "balance": 1.0}
BIAS_MODES = ("selection", "logit")
SELECT_RULES = ("lowest_bias", "highest_bias", "most_used", "least_used")
BUDGETS = ("replace", "append")
STATE_FILE = "condenser.json"


class CondenserRouting(ConventionalRouting):
    """Routing with the layer's bias (selection or logit) and its forced condenser experts."""

    def __init__(self, view, block: MoEBlock, bias_mode: str, budget: str):
        super().__init__(view)
        self.block, self.bias_mode, self.budget = block, bias_mode, budget

    def __call__(self, router, x):
        block = self.block
        logits = self.logits(router, x)
        bias = block.bias.to(logits.device)
        if self.bias_mode == "logit":
            logits = logits + bias.to(logits.dtype)
        forced = block.forced_experts
        top_k = self.rule.top_k + (len(forced) if self.budget == "append" else 0)
        weights, indices = select_topk(
            self.rule, logits, router.training, getattr(router, "e_score_correction_bias", None),
            selection_bias=bias if self.bias_mode == "selection" else None,
            forced=block.forced_expert_ids if forced else None, top_k=top_k,
        )
        return logits, weights, indices


class BiasUpdater:
    """``MoEPatch.update_biases``: one bias update per call; chooses condensers after the warm-up."""

    def __init__(self, patch: MoEPatch, gamma: float, sign: str, center: bool, warmup_steps: int, select):
        self.patch, self.gamma, self.sign = patch, gamma, SIGNS[sign]
        self.center, self.warmup_steps, self.select = center, warmup_steps, select

    def global_loads(self) -> torch.Tensor:
        """int64 [layers, E] loads since the previous update, summed over data-parallel ranks."""
        loads = self.patch.counts().clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = loads.device
            if dist.get_backend() == "nccl":
                loads = loads.cuda()
            dist.all_reduce(loads, op=dist.ReduceOp.SUM)
            loads = loads.to(device)
        return loads

    def __call__(self) -> None:
        loads = self.global_loads()
        with torch.no_grad():
            for layer, load in zip(self.patch.layers, loads):
                load = load.to(layer.bias.device)
                free = torch.ones_like(layer.bias, dtype=torch.bool)
                if layer.forced_experts:
                    free[layer.forced_expert_ids] = False
                mean = load[free].double().mean()
                step = torch.sign(mean - load.double()).float() * (self.gamma * self.sign)
                layer.bias += torch.where(free, step, torch.zeros_like(step))
                if self.center:
                    layer.bias[free] -= layer.bias[free].mean()
                if not layer.forced_experts:
                    layer.warmup_load += load
                layer.bias_updates += 1
        self.patch.reset_counts()
        first = self.patch.layers[0]
        if not first.forced_experts and int(first.bias_updates) == self.warmup_steps:
            choose_condensers(self.patch, self.select)


def choose_condensers(patch: MoEPatch, select) -> dict[int, list[int]]:
    """Fix each layer's condensers by ``select`` (a rule name or ``{layer index: [ids]}``)."""
    chosen = {}
    for layer in patch.layers:
        n = layer.forced_expert_ids.numel()
        if isinstance(select, dict):
            ids = [int(e) for e in select[layer.index]]
        else:
            key = layer.bias if select.endswith("_bias") else layer.warmup_load.double()
            descending = select in ("highest_bias", "most_used")
            ids = torch.sort(key.cpu(), descending=descending, stable=True).indices[:n].tolist()
        layer.forced_expert_ids.copy_(torch.tensor(sorted(ids), dtype=torch.long))
        chosen[layer.index] = layer.forced_experts
    return chosen


def condenser_state(patch: MoEPatch) -> dict:
    """JSON-ready biases, condensers and update count per layer."""
    return {"model_type": patch.spec.model_type, "routing": getattr(patch, "condenser_routing", {}), "layers": {str(layer.index): {"bias": layer.bias.tolist(), "forced_experts": layer.forced_experts,
                                          "updates": int(layer.bias_updates)} for layer in patch.layers}}


def save_condenser_state(patch: MoEPatch, path: str | Path) -> Path:
    """Write :func:`condenser_state` as JSON (the ``bias_file`` format)."""
    path = Path(path)
    path.write_text(json.dumps(condenser_state(patch), indent=1))
    return path


def _load_biases(bias_file: str | Path, patch: MoEPatch) -> None:
    path = Path(bias_file)
    if not path.exists():
        raise FileNotFoundError(f"bias_file={str(path)!r} does not exist (write one with save_condenser_state)")
    state = json.loads(path.read_text())
    saved_type = state.get("model_type", patch.spec.model_type)
    if saved_type != patch.spec.model_type:
        raise ValueError(f"bias_file={str(path)!r} was saved from a {saved_type} model, not "
                         f"{patch.spec.model_type}: it was saved from another model")
    layers = state.get("layers", {})
    ours = sorted(str(layer.index) for layer in patch.layers)
    if sorted(layers) != ours:
        raise ValueError(f"bias_file={str(path)!r} has MoE layers {sorted(layers, key=int)}, this model has "
                         f"{[int(i) for i in ours]}: it was saved from another model")
    for layer in patch.layers:
        entry = layers.get(str(layer.index))
        if entry is None or len(entry.get("bias", [])) != layer.num_experts:
            raise ValueError(f"bias_file={str(path)!r}: no {layer.num_experts}-expert bias for MoE layer "
                             f"{layer.index}; it was saved from another model")
        layer.bias.copy_(torch.tensor(entry["bias"], dtype=torch.float32))


def install_condenser(
    patch: MoEPatch,
    gamma: float = 1e-4,
    sign: str = "sparsify",
    center: bool = False,
    bias_mode: str = "selection",
    n: int = 2,
    warmup_steps: int = 100,
    select: str = "lowest_bias",
    budget: str = "replace",
    experts: dict | None = None,
    bias_file: str | None = None,
) -> None:
    """Install Expert Condenser routing (options as in the module docstring)."""
    _check_choice("sign", sign, SIGNS)
    _check_choice("bias_mode", bias_mode, BIAS_MODES)
    _check_choice("budget", budget, BUDGETS)
    _check_choice("select", select, SELECT_RULES)
    if patch.views[0].rule.score == "sparsemixer":
        raise ValueError("condenser is not defined for sparsemixer routing (phimoe): use another family")
    k, num_experts = patch.layers[0].top_k, patch.layers[0].num_experts
    if not 0 <= n <= (k if budget == "replace" else num_experts - k):
        raise ValueError(f"n={n} condensers do not fit budget={budget!r} with top_k={k} and {num_experts} "
                         "experts: lower n or use budget='append'")
    if n and budget == "replace" and n == k:
        log.warning("condenser: n=%d condensers fill all top_k=%d slots (budget='replace'): after the warm-up "
                    "every token uses only the condensers; lower n or use budget='append'", n, k)
    if experts is not None:
        experts = {int(i): list(ids) for i, ids in experts.items()}
        layers = {layer.index for layer in patch.layers}
        if set(experts) != layers or any(len(ids) != n for ids in experts.values()):
            raise ValueError(f"experts= must list exactly n={n} ids for every MoE layer {sorted(layers)}")
        for i, ids in experts.items():
            if len(set(ids)) != n or not all(0 <= e < num_experts for e in ids):
                raise ValueError(f"experts[{i}]={ids}: need {n} distinct ids in [0, {num_experts})")
    elif n and warmup_steps <= 0 and bias_file is None:
        raise ValueError("warmup_steps=0 would choose condensers from all-zero biases: set warmup_steps>0, "
                         "bias_file= or experts=")
    if bias_file is not None and select in ("most_used", "least_used") and experts is None:
        raise ValueError(f"select={select!r} needs warm-up loads; a bias_file supports lowest_bias/highest_bias")
    for view, layer in zip(patch.views, patch.layers):
        layer.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
        layer.register_buffer("forced_expert_ids", torch.full((n,), -1, dtype=torch.long))
        layer.register_buffer("warmup_load", torch.zeros(num_experts, dtype=torch.long))
        layer.register_buffer("bias_updates", torch.zeros((), dtype=torch.long))
        view.router.moe_lab_policy = CondenserRouting(view, layer, bias_mode, budget)
    if bias_file is not None:
        _load_biases(bias_file, patch)
    if n and (experts is not None or bias_file is not None):
        choose_condensers(patch, experts if experts is not None else select)
    patch.condenser_routing = {"bias_mode": bias_mode, "budget": budget}
    patch.bias_updater = BiasUpdater(patch, gamma, sign, center, warmup_steps if n else -1, select)
    patch.step_hooks.append(patch.update_biases)
    patch.export_hooks.append(functools.partial(_save_beside_export, patch))


def load_condenser(model, directory: str | Path) -> MoEPatch:
    """Install condenser routing on ``model`` (loaded from an export) from the ``condenser.json`` saved there:
    its biases, its condensers (if chosen) and its bias_mode / budget."""
    from .registry import apply

    path = Path(directory) / STATE_FILE
    state = json.loads(path.read_text())
    forced = {int(i): layer["forced_experts"] for i, layer in state["layers"].items()}
    n = len(next(iter(forced.values()), []))
    return apply(model, "condenser", bias_file=str(path), n=n, experts=forced if n else None,
                 **state.get("routing", {}))


def _save_beside_export(patch: MoEPatch, directory) -> None:
    save_condenser_state(patch, Path(directory) / STATE_FILE)


def _check_choice(field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"condenser {field}={value!r}: choose one of {', '.join(allowed)}")
