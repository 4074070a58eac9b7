"""Expert Condenser: a per-layer router bias that sparsifies (or balances) expert load, plus condenser
experts that every token uses.

Per MoE layer: an fp32 bias ``b`` [E] (buffer ``bias``, saved in checkpoints). ``bias_mode`` says where it
enters routing:

* ``logit_selection`` (the paper, default): S = TopK(s + b) with s the raw pre-softmax router logit; the
  gating weights are the family's own rule on the UNBIASED logits (renormalised or not, softmax over the
  top-k, routed scaling, group limits). Sigmoid routers (DeepSeek-V3) take b on the sigmoid affinity, beside
  ``e_score_correction_bias``; GPT-OSS on its logits.
* ``probability_selection`` (a different method, kept by name): b is added to the softmax probabilities
  for selection only (weights unbiased). A bias in probability space acts like b / (p (1 - p)) in logit
  space, so the paper's gamma values do not transfer. For sigmoid and identity (GPT-OSS) routers the
  scores are the affinities / logits, so it coincides with ``logit_selection``.
* ``inside_softmax`` (the public code's variant): b is added to the logits before the family's rule, so
  it changes the weights as well as the selection.

After every optimizer step (after gradient accumulation), :class:`BiasUpdater` applies
``b += gamma * sign * sign(mean_load - load)`` from the loads since the previous update, all-reduced across
data-parallel ranks (``sign``: sparsify = -1, the paper; balance = +1, DeepSeek-V3), optionally re-centred
to zero mean. ``load``: ``count`` (integer tokens per expert, default) or ``soft`` (the public code's soft
usage: the sum over real tokens of each expert's routing probability, see :func:`routing_probabilities`;
under ``inside_softmax`` from the biased logits the routing uses).
Loads are summed into the buffer ``usage`` while the biases learn (before condensers are chosen).

``n`` condenser experts per layer (0: biases only, no condensers) are chosen ONCE by ``select``
(lowest_bias = the paper | highest_bias = ablation M.2 | most_used | least_used): at once from ``experts=``
or a ``bias_file`` (a ``condenser.json`` of an earlier bias-learning run: the public code's two-phase
protocol, see :mod:`moe_lab.tasks.condenser_two_phase`), or after ``warmup_steps`` bias updates in this run.
The warm-up freezes the weights (a true bias-only warm-up: the optimizer sees no gradients, so weights
and optimizer state stay bit-identical) unless ``warmup_trains_weights=True``. Ties between equal biases
are broken by usage in the direction the bias follows usage (sparsify: bias rises with usage, so among
equal biases ``lowest_bias`` takes the least used; balance: the reverse), never by expert index; only
experts equal in bias AND usage (indistinguishable) fall back to index order, with a warning.
Condensers are forced into every token's active set, gated by their router weight: ``budget="replace"``
keeps |S| = k (top-(k-n) + n condensers, the paper), ``"append"`` uses k + n. Their biases are frozen
once chosen; the others keep updating over the non-condenser experts. Aux loss off for this method.
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
from ..moe.stats import in_backward_pass
from ..moe.support import refuse_undefined

log = logging.getLogger(__name__)

SIGNS = {"sparsify": -1.0, "balance": 1.0}
# bias_mode -> where select_topk adds the bias (None: inside the softmax, on the logits before the rule)
BIAS_MODES = {"logit_selection": "logits", "probability_selection": "scores", "inside_softmax": None}
LEGACY_BIAS_MODES = {"selection": "probability_selection", "logit": "inside_softmax"}  # exports before renaming
SELECT_RULES = ("lowest_bias", "highest_bias", "most_used", "least_used")
BUDGETS = ("replace", "append")
LOADS = ("count", "soft")
STATE_FILE = "condenser.json"


def routing_probabilities(rule, logits: torch.Tensor) -> torch.Tensor:
    """fp32 [N, E] per-token routing distribution over all experts (soft usage): the softmax of the logits
    (softmax routers; GPT-OSS, whose weights are a softmax of its logits), or the sigmoid affinities divided
    by their sum for sigmoid routers (DeepSeek-V3's normalised affinity)."""
    if rule.score == "sigmoid":
        affinity = logits.float().sigmoid()
        return affinity / affinity.sum(dim=-1, keepdim=True)
    return torch.softmax(logits.float(), dim=-1)


class CondenserRouting(ConventionalRouting):
    """Routing with the layer's bias (placed by ``bias_mode``) and its forced condenser experts."""

    def __init__(self, view, block: MoEBlock, bias_mode: str, budget: str, soft_load: bool):
        super().__init__(view)
        self.block, self.bias_space, self.budget = block, BIAS_MODES[bias_mode], budget
        self.inside = bias_mode == "inside_softmax"
        self.soft_load = soft_load
        self.shape: tuple[int, int] | None = None

    def remember_shape(self, block, args):
        """Forward pre-hook on the block: its [batch, seq] (to mask pad tokens out of the soft usage)."""
        self.shape = tuple(args[0].shape[:2])

    def __call__(self, router, x):
        block = self.block
        logits = self.logits(router, x)
        bias = block.bias.to(logits.device)
        if self.inside:
            logits = logits + bias.to(logits.dtype)
        forced = block.forced_experts
        top_k = self.rule.top_k + (len(forced) if self.budget == "append" else 0)
        weights, indices = select_topk(
            self.rule, logits, router.training, self.view.correction_bias,
            selection_bias=None if self.inside else bias, bias_space=self.bias_space or "logits",
            forced=block.forced_expert_ids if forced else None, top_k=top_k,
        )
        if self.soft_load:
            self._add_soft_usage(logits)
        return logits, weights, indices

    def _add_soft_usage(self, logits: torch.Tensor) -> None:
        """Sum the routing probabilities of the real tokens into ``block.soft_load`` (float64), under the
        same conditions as the block's integer counts: training or calibrating, once per token."""
        block, context = self.block, self.block.context.obj
        if not (block.training or context.calibrating) or in_backward_pass():
            return
        with torch.no_grad():
            probs = routing_probabilities(self.rule, logits.detach())
            mask = context.token_mask(*self.shape) if self.shape is not None else None
            if mask is not None:
                probs = probs[mask.to(probs.device)]
            if block.soft_load.device != probs.device:
                block.soft_load = block.soft_load.to(probs.device)
            block.soft_load += probs.sum(dim=0, dtype=torch.float64)


class BiasUpdater:
    """``MoEPatch.update_biases``: one bias update per call; chooses condensers after the warm-up."""

    def __init__(self, patch: MoEPatch, gamma: float, sign: str, center: bool, warmup_steps: int, select,
                 load: str = "count", warmup_trains_weights: bool = False):
        self.patch, self.gamma, self.sign_name, self.sign = patch, gamma, sign, SIGNS[sign]
        self.center, self.warmup_steps, self.select, self.load = center, warmup_steps, select, load
        self.warmup_trains_weights = warmup_trains_weights
        self.freeze_handled = False
        self._warned_unfrozen = False

    @property
    def freezes_weights(self) -> bool:
        """True during a frozen (bias-only) warm-up: the next optimizer step must not change the weights."""
        return (self.warmup_steps > 0 and not self.warmup_trains_weights
                and not self.patch.layers[0].forced_experts)

    def before_optimizer_step(self, optimizer) -> None:
        """Call before every ``optimizer.step()``: during a frozen warm-up, drop every gradient of
        ``optimizer``'s parameters so that it skips them (weights and optimizer state stay bit-identical)."""
        self.freeze_handled = True
        if self.freezes_weights:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def local_loads(self) -> torch.Tensor:
        """[layers, E] loads since the previous update on this rank (int64 counts or float64 soft usage)."""
        if self.load == "soft":
            return torch.stack([layer.soft_load for layer in self.patch.layers])
        return self.patch.counts().clone()

    def global_loads(self) -> torch.Tensor:
        """float64 [layers, E] loads since the previous update, summed over data-parallel ranks."""
        loads = self.local_loads()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = loads.device
            if dist.get_backend() == "nccl":
                loads = loads.cuda()
            dist.all_reduce(loads, op=dist.ReduceOp.SUM)
            loads = loads.to(device)
        return loads.double()

    def reset(self) -> None:
        self.patch.reset_counts()
        for layer in self.patch.layers:
            layer.soft_load.zero_()

    def __call__(self) -> None:
        if self.freezes_weights and not self.freeze_handled and not self._warned_unfrozen:
            self._warned_unfrozen = True
            log.warning("condenser: warmup_trains_weights=false, but nothing dropped the gradients before the "
                        "optimizer step: use moe_lab.methods.condenser_module.CondenserModule (method=condenser "
                        "does) or call patch.bias_updater.before_optimizer_step(optimizer) before each step")
        loads = self.global_loads()
        with torch.no_grad():
            for layer, load in zip(self.patch.layers, loads):
                load = load.to(layer.bias.device)
                free = torch.ones_like(layer.bias, dtype=torch.bool)
                if layer.forced_experts:
                    free[layer.forced_expert_ids] = False
                mean = load[free].mean()
                step = torch.sign(mean - load).float() * (self.gamma * self.sign)
                layer.bias += torch.where(free, step, torch.zeros_like(step))
                if self.center:
                    layer.bias[free] -= layer.bias[free].mean()
                if not layer.forced_experts:
                    layer.usage += load.to(layer.usage.device)
                layer.bias_updates += 1
        self.reset()
        first = self.patch.layers[0]
        if not first.forced_experts and int(first.bias_updates) == self.warmup_steps:
            choose_condensers(self.patch, self.select, self.sign_name)


def condenser_order(bias: torch.Tensor, usage: torch.Tensor, select: str, sign: str) -> torch.Tensor:
    """Expert ids in ``select`` order. Primary key: bias (``*_bias``) or usage (``*_used``); ties are broken
    by the other key, oriented as the bias follows usage under ``sign`` (sparsify: up with usage; balance:
    down); experts equal in both keep index order."""
    follows = -SIGNS[sign]  # +1: bias rises with usage
    bias, usage = bias.double().cpu(), usage.double().cpu()
    primary, secondary = (bias, follows * usage) if select.endswith("_bias") else (usage, follows * bias)
    descending = select in ("highest_bias", "most_used")
    order = torch.arange(bias.numel())
    for key in (secondary, primary):  # least significant key first; stable sorts keep the earlier order
        order = order[torch.sort(key[order], descending=descending, stable=True).indices]
    return order


def choose_condensers(patch: MoEPatch, select, sign: str = "sparsify") -> dict[int, list[int]]:
    """Fix each layer's condensers by ``select`` (a rule name, see :func:`condenser_order`, or
    ``{layer index: [ids]}``)."""
    chosen = {}
    for layer in patch.layers:
        n = layer.forced_expert_ids.numel()
        if isinstance(select, dict):
            ids = [int(e) for e in select[layer.index]]
        else:
            order = condenser_order(layer.bias, layer.usage, select, sign)
            ids = order[:n].tolist()
            if 0 < n < layer.num_experts:
                last, first_out = int(order[n - 1]), int(order[n])
                if layer.bias[last] == layer.bias[first_out] and layer.usage[last] == layer.usage[first_out]:
                    log.warning("condenser: layer %d: experts %d and %d have equal bias and usage; %d taken by "
                                "index order", layer.index, last, first_out, last)
        layer.forced_expert_ids.copy_(torch.tensor(sorted(ids), dtype=torch.long))
        chosen[layer.index] = layer.forced_experts
    return chosen


def condenser_state(patch: MoEPatch) -> dict:
    """JSON-ready biases, condensers, usage and update count per layer, with the routing options."""
    return {
        "model_type": patch.spec.model_type,
        "routing": getattr(patch, "condenser_routing", {}),
        "layers": {str(layer.index): {"num_experts": layer.num_experts, "bias": layer.bias.tolist(),
                                      "forced_experts": layer.forced_experts, "usage": layer.usage.tolist(),
                                      "updates": int(layer.bias_updates)} for layer in patch.layers},
    }


def save_condenser_state(patch: MoEPatch, path: str | Path) -> Path:
    """Write :func:`condenser_state` as JSON (the ``bias_file`` format)."""
    path = Path(path)
    path.write_text(json.dumps(condenser_state(patch), indent=1))
    return path


def read_bias_file(bias_file: str | Path, patch: MoEPatch) -> dict:
    """The JSON of ``bias_file``, refused (naming the file, what it holds and what the model has) unless
    it was saved from a model of the same family, MoE layers and expert counts."""
    path = Path(bias_file)
    if not path.is_file():
        raise FileNotFoundError(f"bias_file={str(path)!r} does not exist (a run with method=condenser writes "
                                f"<run dir>/{STATE_FILE}; save_condenser_state writes one)")
    state = json.loads(path.read_text())
    layers = state.get("layers", {})
    held = {int(i): len(entry.get("bias", [])) for i, entry in layers.items()}
    ours = {layer.index: layer.num_experts for layer in patch.layers}
    saved_type = state.get("model_type", patch.spec.model_type)
    if saved_type != patch.spec.model_type or held != ours:
        raise ValueError(
            f"bias_file={str(path)!r} holds biases of a {saved_type} model with MoE layers "
            f"{_describe(held)}; this {patch.spec.model_type} model has MoE layers {_describe(ours)}: "
            "use a bias file saved from this model"
        )
    return state


def _describe(layers: dict[int, int]) -> str:
    return "{" + ", ".join(f"{i}: {e} experts" for i, e in sorted(layers.items())) + "}"


def _load_biases(state: dict, patch: MoEPatch) -> bool:
    """Copy a bias file's biases (and usage, if it has it) into the layers; True if it had usage."""
    has_usage = all("usage" in entry for entry in state["layers"].values())
    for layer in patch.layers:
        entry = state["layers"][str(layer.index)]
        layer.bias.copy_(torch.tensor(entry["bias"], dtype=torch.float32))
        if has_usage:
            layer.usage.copy_(torch.tensor(entry["usage"], dtype=torch.float64))
    return has_usage


def install_condenser(
    patch: MoEPatch,
    gamma: float = 1e-4,
    sign: str = "sparsify",
    center: bool = False,
    bias_mode: str = "logit_selection",
    load: str = "count",
    n: int = 2,
    warmup_steps: int = 100,
    warmup_trains_weights: bool = False,
    select: str = "lowest_bias",
    budget: str = "replace",
    experts: dict | None = None,
    bias_file: str | None = None,
) -> None:
    """Install Expert Condenser routing (options as in the module docstring)."""
    _check_choice("sign", sign, SIGNS)
    if bias_mode in LEGACY_BIAS_MODES:
        raise ValueError(f"condenser bias_mode={bias_mode!r} was renamed {LEGACY_BIAS_MODES[bias_mode]!r}; "
                         f"choose one of {', '.join(BIAS_MODES)}")
    _check_choice("bias_mode", bias_mode, BIAS_MODES)
    _check_choice("load", load, LOADS)
    _check_choice("budget", budget, BUDGETS)
    _check_choice("select", select, SELECT_RULES)
    if not isinstance(warmup_trains_weights, bool):
        raise TypeError(f"condenser warmup_trains_weights={warmup_trains_weights!r}: choose true or false")
    refuse_undefined("condenser", patch.spec, patch.views[0].rule)
    k, num_experts = patch.layers[0].top_k, patch.layers[0].num_experts
    if not 0 <= n <= (k if budget == "replace" else num_experts - k):
        raise ValueError(f"n={n} condensers do not fit budget={budget!r} with top_k={k} and {num_experts} "
                         "experts: lower n or use budget='append'")
    if n and budget == "replace" and n == k:
        log.warning("condenser: n=%d condensers fill all top_k=%d slots (budget='replace'): once chosen every "
                    "token uses only the condensers; lower n or use budget='append'", n, k)
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
    state = read_bias_file(bias_file, patch) if bias_file is not None else None
    for view, layer in zip(patch.views, patch.layers):
        layer.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
        layer.register_buffer("forced_expert_ids", torch.full((n,), -1, dtype=torch.long))
        layer.register_buffer("usage", torch.zeros(num_experts, dtype=torch.float64))
        layer.register_buffer("bias_updates", torch.zeros((), dtype=torch.long))
        # a plain tensor, not a buffer: DDP broadcasts buffers from rank 0 and would overwrite local sums
        layer.soft_load = torch.zeros(num_experts, dtype=torch.float64)
        policy = CondenserRouting(view, layer, bias_mode, budget, soft_load=load == "soft")
        if load == "soft":
            layer.register_forward_pre_hook(policy.remember_shape)
        view.router.moe_lab_policy = policy
    if state is not None:
        has_usage = _load_biases(state, patch)
        if n and experts is None and not has_usage:
            if select.endswith("_used"):
                raise ValueError(f"select={select!r} needs usage, and bias_file={bias_file!r} has none "
                                 "(written before usage was saved): use lowest_bias/highest_bias")
            log.warning("condenser: bias_file=%r has no usage: ties between equal biases fall back to index "
                        "order", bias_file)
    if n and (experts is not None or state is not None):
        choose_condensers(patch, experts if experts is not None else select, sign)
    patch.condenser_routing = {"bias_mode": bias_mode, "budget": budget, "load": load}
    patch.bias_updater = BiasUpdater(patch, gamma, sign, center, warmup_steps if n else -1, select, load,
                                     warmup_trains_weights)
    patch.step_hooks.append(patch.update_biases)
    patch.export_hooks.append(functools.partial(_save_beside_export, patch))


def load_condenser(model, directory: str | Path) -> MoEPatch:
    """Install condenser routing on ``model`` (loaded from an export) from the ``condenser.json`` saved there:
    its biases, its condensers (if chosen) and its routing options (bias_mode, budget, load)."""
    from .registry import apply

    path = Path(directory) / STATE_FILE
    state = json.loads(path.read_text())
    forced = {int(i): layer["forced_experts"] for i, layer in state["layers"].items()}
    n = len(next(iter(forced.values()), []))
    routing = dict(state.get("routing", {}))
    if routing.get("bias_mode") in LEGACY_BIAS_MODES:
        routing["bias_mode"] = LEGACY_BIAS_MODES[routing["bias_mode"]]
    return apply(model, "condenser", bias_file=str(path), n=n, experts=forced if n else None, **routing)


def _save_beside_export(patch: MoEPatch, directory) -> None:
    save_condenser_state(patch, Path(directory) / STATE_FILE)


def _check_choice(field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"condenser {field}={value!r}: choose one of {', '.join(allowed)}")
