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

:class:`BiasUpdater` applies ``b += gamma * sign * sign(mean_load - load)`` from the loads since the previous
update, all-reduced across data-parallel ranks (``sign``: sparsify = -1, the paper; balance = +1,
DeepSeek-V3), optionally re-centred to zero mean; ``update_every``: ``optimizer_step`` (the paper, after
gradient accumulation) or ``micro_batch`` (the public code's OLMoE patch). ``load``: ``count`` (integer
tokens per expert, default), ``soft`` (the sum over real tokens of each expert's routing probability, see
:func:`routing_probabilities`; under ``inside_softmax`` from the biased logits the routing uses) or
``soft_all_tokens`` (the public code: pad tokens counted too). Loads are summed into the buffer ``usage``
until the condensers are chosen.

``n`` condenser experts per layer (0: biases only, no condensers) are chosen ONCE by ``select``
(lowest_bias = the paper | highest_bias = ablation M.2 | most_used | least_used), from biases learned as
``selection`` says:

* ``pre_phase`` (default): before training, a forward-only pass (no gradients, no optimizer, no LR-schedule
  step) over the first training micro-batches makes ``selection_updates`` bias updates (each from the loads
  of one optimizer step's micro-batches, or one micro-batch under ``update_every=micro_batch``); then the
  condensers are fixed and training runs all its steps from step 0 (:func:`run_selection_phase`; method=
  condenser runs it in :class:`~moe_lab.methods.condenser_module.CondenserModule`).
* ``in_run``: the biases learn during training while the weights train; the condensers are chosen after
  ``selection_updates`` updates (the run before that routes without condensers).

``experts=`` or a ``bias_file`` (a ``condenser.json`` of an earlier run: the public code's two-phase protocol,
see :mod:`moe_lab.tasks.condenser_two_phase`) fix them at once instead. Ties between equal biases are broken
by usage in the direction the bias follows usage (sparsify: bias rises with usage, so among equal biases
``lowest_bias`` takes the least used; balance: the reverse), never by expert index; only experts equal in
bias AND usage (indistinguishable) fall back to index order, with a warning. Condensers are forced into every
token's active set, gated by their router weight: ``budget="replace"`` keeps |S| = k (top-(k-n) + n
condensers, the paper), ``"append"`` uses k + n distinct experts, ``"append_all"`` (the public code) appends
the condensers to the top-k over ALL experts, so a condenser in the top-k counts twice. ``condenser_bias``:
``frozen`` (the paper's reading: the other biases keep updating, the mean over the non-condenser experts) or
``updating`` (the public code: every bias updates, the mean over all experts). Aux loss off for this method.
:data:`PUBLIC_CODE` holds the public code's choices (``method=condenser_public_code``).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ..analysis.estimate import CostContext, register_cost_row
from ..core.atomic import atomic_write_json
from ..moe.block import ConventionalRouting, MoEBlock
from ..moe.patch import MoEPatch
from ..moe.routing import select_topk
from ..moe.stats import in_backward_pass
from ..moe.support import sparsemixer_only
from .registry import apply, method_spec, register_export_loader, register_method

log = logging.getLogger(__name__)

SIGNS = {"sparsify": -1.0, "balance": 1.0}
# bias_mode -> where select_topk adds the bias (None: inside the softmax, on the logits before the rule)
BIAS_MODES = {"logit_selection": "logits", "probability_selection": "scores", "inside_softmax": None}
LEGACY_BIAS_MODES = {"selection": "probability_selection", "logit": "inside_softmax"}  # exports before renaming
SELECT_RULES = ("lowest_bias", "highest_bias", "most_used", "least_used")
BUDGETS = ("replace", "append", "append_all")
LOADS = ("count", "soft", "soft_all_tokens")
SELECTIONS = ("pre_phase", "in_run")
CONDENSER_BIASES = ("frozen", "updating")
UPDATE_EVERY = ("optimizer_step", "micro_batch")
STATE_FILE = "condenser.json"
#: the authors' public code (its OLMoE patch) where it differs from the paper's rule
PUBLIC_CODE = {"bias_mode": "inside_softmax", "budget": "append_all", "load": "soft_all_tokens",
               "condenser_bias": "updating", "update_every": "micro_batch"}


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

    def __init__(self, view, block: MoEBlock, bias_mode: str, budget: str, load: str):
        super().__init__(view)
        self.block, self.bias_space, self.budget = block, BIAS_MODES[bias_mode], budget
        self.inside = bias_mode == "inside_softmax"
        self.soft_load, self.pad_tokens_count = load != "count", load == "soft_all_tokens"
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
        forced = block.forced_expert_ids if block.forced_experts else None
        appended = self.budget == "append_all"
        top_k = self.rule.top_k + (len(forced) if forced is not None and self.budget == "append" else 0)
        weights, indices = select_topk(
            self.rule, logits, router.training, self.view.correction_bias,
            selection_bias=None if self.inside else bias, bias_space=self.bias_space or "logits",
            forced=None if appended else forced, top_k=top_k, append=forced if appended else None,
        )
        if self.soft_load:
            self._add_soft_usage(logits)
        return logits, weights, indices

    def _add_soft_usage(self, logits: torch.Tensor) -> None:
        """Sum the routing probabilities of the tokens (real ones, or all with ``soft_all_tokens``) into
        ``block.soft_load`` (float64), under the same conditions as the block's integer counts: training or
        calibrating, once per token."""
        block, context = self.block, self.block.context.obj
        if not (block.training or context.calibrating) or in_backward_pass():
            return
        with torch.no_grad():
            probs = routing_probabilities(self.rule, logits.detach())
            mask = None if self.pad_tokens_count or self.shape is None else context.token_mask(*self.shape)
            if mask is not None:
                probs = probs[mask.to(probs.device)]
            if block.soft_load.device != probs.device:
                block.soft_load = block.soft_load.to(probs.device)
            block.soft_load += probs.sum(dim=0, dtype=torch.float64)


def _sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over the data-parallel ranks (itself without a process group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = values.device
        if dist.get_backend() == "nccl":
            values = values.cuda()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values = values.to(device)
    return values


class BiasUpdater:
    """``MoEPatch.update_biases``: one bias update per call; under ``selection=in_run`` it chooses the
    condensers after ``selection_updates`` updates."""

    def __init__(self, patch: MoEPatch, gamma: float, sign: str, center: bool, select, load: str = "count",
                 selection: str = "pre_phase", selection_updates: int = 20, condenser_bias: str = "frozen",
                 update_every: str = "optimizer_step"):
        self.patch, self.gamma, self.sign_name, self.sign = patch, gamma, sign, SIGNS[sign]
        self.center, self.select, self.load = center, select, load
        self.selection, self.selection_updates = selection, selection_updates
        self.condenser_bias, self.update_every = condenser_bias, update_every
        self.in_pre_phase = False

    @property
    def pending(self) -> bool:
        """True while condensers are still to be chosen (n > 0 and none chosen yet)."""
        first = self.patch.layers[0]
        return first.forced_expert_ids.numel() > 0 and not first.forced_experts

    def local_loads(self) -> torch.Tensor:
        """[layers, E] loads since the previous update on this rank (int64 counts or float64 soft usage)."""
        if self.load != "count":
            return torch.stack([layer.soft_load for layer in self.patch.layers])
        return self.patch.counts().clone()

    def global_loads(self) -> torch.Tensor:
        """float64 [layers, E] loads since the previous update, summed over data-parallel ranks."""
        return _sum_over_ranks(self.local_loads()).double()

    def reset(self) -> None:
        self.patch.reset_counts()
        for layer in self.patch.layers:
            layer.soft_load.zero_()

    def __call__(self) -> None:
        if self.selection == "pre_phase" and self.pending and not self.in_pre_phase:
            raise RuntimeError(
                "condenser selection=pre_phase: the condensers are chosen by a forward-only pass before training "
                "(run_selection_phase; method=condenser's CondenserModule runs it at fit start), and it has not "
                "run; run it first, or choose selection=in_run, experts= or bias_file=")
        loads = self.global_loads()
        pending = self.pending
        with torch.no_grad():
            for layer, load in zip(self.patch.layers, loads):
                load = load.to(layer.bias.device)
                free = torch.ones_like(layer.bias, dtype=torch.bool)
                if layer.forced_experts and self.condenser_bias == "frozen":
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
        if pending and self.selection == "in_run" and int(first.bias_updates) == self.selection_updates:
            chosen = choose_condensers(self.patch, self.select, self.sign_name)
            log.info("condenser: condensers chosen in the run after %d bias updates on %s tokens: %s",
                     self.selection_updates, f"{selection_tokens(self.patch):,.0f}", condenser_summary(chosen))


def selection_tokens(patch: MoEPatch) -> float:
    """Tokens the biases learned from before the condensers were chosen (while they are not: so far), from the
    first layer's ``usage`` (integer counts hold k slots per token; soft usage one per token)."""
    layer, load = patch.layers[0], patch.bias_updater.load
    return float(layer.usage.sum()) / (layer.top_k if load == "count" else 1)


def condenser_summary(chosen: dict[int, list[int]], most: int = 4) -> str:
    """``layer i [ids]; ...`` for the first ``most`` layers (a log line)."""
    items = [f"layer {i} {ids}" for i, ids in list(chosen.items())[:most]]
    return "; ".join(items) + (f"; ... ({len(chosen)} layers)" if len(chosen) > most else "")


def run_selection_phase(patch: MoEPatch, batches: Iterator, forward: Callable[[object], int],
                        micro_batches_per_step: int = 1) -> dict:
    """The ``selection=pre_phase`` protocol: with no gradients, ``selection_updates`` bias updates, each from
    the loads of the next ``micro_batches_per_step`` batches of ``batches`` (one batch under
    ``update_every=micro_batch``), all-reduced over data-parallel ranks; then the condensers are chosen.

    ``forward(batch)`` runs the model (in training mode, so loads are counted) and returns the batch's real
    tokens. Weights, gradients and optimizer are untouched; the layers' ``total_counts`` (the training's routing
    statistics) are restored. Returns ``{"updates", "micro_batches", "tokens", "condensers"}`` (tokens and
    micro-batches summed over ranks)."""
    updater = patch.bias_updater
    if updater is None or not updater.pending:
        raise ValueError("run_selection_phase needs a condenser patch with n >= 1 whose condensers are not chosen")
    per_update = 1 if updater.update_every == "micro_batch" else int(micro_batches_per_step)
    totals = [layer.total_counts.clone() for layer in patch.layers]
    updater.reset()
    tokens, micro = 0, 0
    updater.in_pre_phase = True
    try:
        with torch.no_grad():
            for _ in range(updater.selection_updates):
                for _ in range(per_update):
                    tokens += int(forward(next(batches)))
                    micro += 1
                updater()
    finally:
        updater.in_pre_phase = False
        for layer, total in zip(patch.layers, totals):
            layer.total_counts = total.to(layer.total_counts.device)
    chosen = choose_condensers(patch, updater.select, updater.sign_name)
    summed = _sum_over_ranks(torch.tensor([tokens, micro], dtype=torch.long))
    return {"updates": updater.selection_updates, "micro_batches": int(summed[1]), "tokens": int(summed[0]),
            "condensers": chosen}


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
    """JSON-ready biases, condensers, usage and update count per layer, with the routing options and the tokens
    the biases learned from before the condensers were chosen (``selection_tokens``)."""
    return {
        "model_type": patch.spec.model_type,
        "routing": getattr(patch, "condenser_routing", {}),
        "selection_tokens": selection_tokens(patch),
        "layers": {str(layer.index): {"num_experts": layer.num_experts, "bias": layer.bias.tolist(),
                                      "forced_experts": layer.forced_experts, "usage": layer.usage.tolist(),
                                      "updates": int(layer.bias_updates)} for layer in patch.layers},
    }


def save_condenser_state(patch: MoEPatch, path: str | Path) -> Path:
    """Write :func:`condenser_state` as JSON (the ``bias_file`` format), atomically."""
    return atomic_write_json(path, condenser_state(patch), indent=1)


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


def cost_row(cfg) -> str:
    """The estimate's row of a condenser run: its condenser budget (``replace`` or ``append``)."""
    return f"condenser_{OmegaConf.select(cfg, 'method.options.budget', default='replace')}"


def plan_lines(cfg, length: dict | None) -> list[str]:
    """When the condensers are chosen and the router biases move (``plan=true``)."""
    out = []
    total = length["optimizer_steps"] if length else None
    o = cfg.method.options
    if o.get("experts"):
        out.append("condensers: given (method.options.experts), fixed from step 0")
    elif o.get("bias_file"):
        out.append(f"condensers: chosen at the start from the biases of {o.bias_file}")
    elif int(o.get("n", 0)):
        u = int(o.selection_updates)
        if o.get("selection", "pre_phase") == "pre_phase":
            per = 1 if o.get("update_every") == "micro_batch" else int(cfg.task.trainer.accumulate_grad_batches)
            when = (f"before step 0 by a forward-only pre-phase: {u} bias updates x {per} micro-batch(es) per "
                    "rank (no gradients, no optimizer or LR-schedule step)")
            if length:
                when += f" = {u * per / length['micro_batches_per_epoch']:.2f} epochs of forwards"
        else:
            when = f"during training after {u} bias updates (weights train from step 0)"
            if total is not None:
                when += (f"; NEVER within this run's {total} steps: refused" if u >= total
                         else f" = {u / length['steps_per_epoch']:.2f} epochs of {length['epochs']:.2f}")
        out.append(f"condensers ({o.n} per layer): chosen {when}")
    out.append(f"router biases: updated every optimizer step (gamma {o.gamma}, {o.sign})")
    return out


@register_method("condenser", expert_parallel=True, cost_row=cost_row, plan_lines=plan_lines,
                 undefined_for=sparsemixer_only("selection biases and forced experts are not defined for sparsemixer "
                                                "routing"))
def install_condenser(
    patch: MoEPatch,
    gamma: float = 1e-4,
    sign: str = "sparsify",
    center: bool = False,
    bias_mode: str = "logit_selection",
    load: str = "count",
    n: int = 2,
    selection: str = "pre_phase",
    selection_updates: int = 20,
    select: str = "lowest_bias",
    budget: str = "replace",
    condenser_bias: str = "frozen",
    update_every: str = "optimizer_step",
    experts: dict | None = None,
    bias_file: str | None = None,
) -> None:
    """Install Expert Condenser routing (options as in the module docstring)."""
    _check_choice("sign", sign, SIGNS)
    if not float(gamma) >= 0:  # NaN too
        raise ValueError(f"method.options.gamma={gamma}: the bias step must be >= 0; the direction is "
                         f"method.options.sign ({' | '.join(SIGNS)}), not gamma's sign")
    if bias_mode in LEGACY_BIAS_MODES:
        raise ValueError(f"condenser bias_mode={bias_mode!r} was renamed {LEGACY_BIAS_MODES[bias_mode]!r}; "
                         f"choose one of {', '.join(BIAS_MODES)}")
    _check_choice("bias_mode", bias_mode, BIAS_MODES)
    for field, value, allowed in (("load", load, LOADS), ("budget", budget, BUDGETS),
                                  ("select", select, SELECT_RULES), ("selection", selection, SELECTIONS),
                                  ("condenser_bias", condenser_bias, CONDENSER_BIASES),
                                  ("update_every", update_every, UPDATE_EVERY)):
        _check_choice(field, value, allowed)
    method_spec("condenser").refuse_undefined(patch.spec, patch.views[0].rule)
    k, num_experts = patch.layers[0].top_k, patch.layers[0].num_experts
    most = {"replace": k, "append": num_experts - k, "append_all": num_experts}[budget]
    if not 0 <= n <= most:
        raise ValueError(f"n={n} condensers do not fit budget={budget!r} with top_k={k} and {num_experts} "
                         f"experts (at most {most}): lower n or use another budget")
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
    elif n and bias_file is None and (isinstance(selection_updates, bool) or int(selection_updates) < 1):
        raise ValueError(f"selection_updates={selection_updates} would choose the condensers from all-zero "
                         "biases: set selection_updates >= 1, bias_file= or experts=")
    state = read_bias_file(bias_file, patch) if bias_file is not None else None
    for view, layer in zip(patch.views, patch.layers):
        layer.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
        layer.register_buffer("forced_expert_ids", torch.full((n,), -1, dtype=torch.long))
        layer.register_buffer("usage", torch.zeros(num_experts, dtype=torch.float64))
        layer.register_buffer("bias_updates", torch.zeros((), dtype=torch.long))
        # a plain tensor, not a buffer: DDP broadcasts buffers from rank 0 and would overwrite local sums
        layer.soft_load = torch.zeros(num_experts, dtype=torch.float64)
        policy = CondenserRouting(view, layer, bias_mode, budget, load)
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
    patch.bias_updater = BiasUpdater(patch, gamma, sign, center, select, load, selection, int(selection_updates),
                                     condenser_bias, update_every)
    if update_every == "optimizer_step":  # micro_batch: CondenserModule.on_after_backward, every micro-batch
        patch.step_hooks.append(patch.update_biases)
    patch.export_hooks.append(functools.partial(_save_beside_export, patch))


@register_export_loader(STATE_FILE)
def load_condenser(model, directory: str | Path) -> MoEPatch:
    """Install condenser routing on ``model`` (loaded from an export) from the ``condenser.json`` saved there:
    its biases, its condensers (if chosen) and its routing options (bias_mode, budget, load)."""
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


@register_cost_row("condenser_replace", order=20)
def condenser_replace_costs(ctx: CostContext) -> dict:
    """The estimate's row of ``budget=replace``: |S| = k, SFT's costs."""
    return ctx.row(ctx.sft_f, ctx.sft_b, ctx.counts.total, ctx.assign_k,
                   note="|S| = k: top-(k-n) + n condensers")


@register_cost_row("condenser_append", order=30)
def condenser_append_costs(ctx: CostContext) -> dict:
    """The estimate's row of ``budget=append``: |S| = k + n experts per token (``condenser_n``)."""
    n = ctx.opts.condenser_n
    return ctx.row(ctx.f_rest + ctx.experts(lambda s: s.top_k + n),
                   ctx.b_rest + 2 * ctx.experts(lambda s: s.top_k + n), ctx.counts.total,
                   ctx.assign_k + n * len(ctx.k), note=f"|S| = k + {n}",
                   active_top_k={i: v + n for i, v in ctx.k.items()})
