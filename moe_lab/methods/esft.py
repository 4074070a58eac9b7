"""ESFT: Expert-Specialized Fine-Tuning (Wang et al., 2024, "Let the Expert Stick to His Last",
arXiv:2407.01906, code github.com/deepseek-ai/ESFT).

1. Score every routed expert on task data with one routing-statistics pass (:func:`esft_scores`):

   - ``gate``  = mean over tokens of the expert's top-k gate weight (0 when not selected),
   - ``token`` = mean over tokens of 1[selected] / K,

   each averaged over a sequence's real (non-pad) tokens, then over sequences (the paper's
   definition; ``average="token"`` pools all tokens instead, as the public scoring script does).
2. Per layer, add experts by descending score until the cumulative score reaches ``p``, the crossing
   expert included (:func:`esft_select`).
3. Train only the selected routed experts (slices of the packed expert tensors); router, attention,
   norms, shared experts, embeddings, lm_head and dense-layer MLPs stay frozen unless a ``train_*``
   flag unfreezes them (``moe_lab.apply(model, "esft", experts=...)``).

Unselected expert slices stay bit-identical under ANY torch optimizer, also outside Lightning (e.g.
``torch.optim.AdamW(model.parameters(), lr=...)`` with its default weight_decay=0.01, a TRL loop): their
gradients are zeroed by hooks, and :class:`FrozenSliceGuard` (torch's global optimizer step hooks) copies
them before every step that could move them and writes them back after it (see its docstring).
:func:`slice_optimizer` (used by the ESFT Lightning module) lets an element-wise optimizer step only the
trained slices, so the frozen ones cost no optimizer arithmetic.
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from transformers.integrations.moe import _grouped_linear

from ..analysis.estimate import CostContext, register_cost_row
from ..moe.block import MoEBlock, sparse_mixture, split_router_output
from ..moe.experts import looped_mixture
from ..moe.patch import MoEPatch
from .compressed_experts import packed_layout
from .registry import register_method
from .slice_decay import trained_runs

SCORES = ("gate", "token")
AVERAGES = ("sequence", "token")
# cumulative scores within this of p count as having reached it (absorbs float rounding of sums)
_REACH_TOLERANCE = 1e-9


# scoring ---------------------------------------------------------------------------------------
@dataclass
class ESFTStatistics:
    """Sums behind the ESFT scores of every MoE layer, ready to be all-reduced across ranks.

    ``gate_seq``/``token_seq`` [L, E]: sums over sequences of each sequence's mean; ``gate_tok``/
    ``token_tok`` [L, E]: sums over all real tokens; ``sequences``/``tokens``: counts (float64).
    """

    layers: list[int]
    num_experts: int
    gate_seq: torch.Tensor = None
    token_seq: torch.Tensor = None
    gate_tok: torch.Tensor = None
    token_tok: torch.Tensor = None
    counts: torch.Tensor = field(default=None)  # [sequences, tokens]

    def __post_init__(self):
        shape = (len(self.layers), self.num_experts)
        for name in ("gate_seq", "token_seq", "gate_tok", "token_tok"):
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(shape, dtype=torch.float64))
        if self.counts is None:
            self.counts = torch.zeros(2, dtype=torch.float64)

    @property
    def sequences(self) -> int:
        return int(self.counts[0])

    @property
    def tokens(self) -> int:
        return int(self.counts[1])

    def packed(self) -> torch.Tensor:
        """All sums in one flat float64 tensor (for one all-reduce)."""
        return torch.cat([self.gate_seq.flatten(), self.token_seq.flatten(), self.gate_tok.flatten(),
                          self.token_tok.flatten(), self.counts])

    def unpack(self, flat: torch.Tensor) -> None:
        """Inverse of :meth:`packed` (e.g. after an all-reduce)."""
        n = len(self.layers) * self.num_experts
        parts = flat.detach().to("cpu", torch.float64).split([n, n, n, n, 2])
        shape = (len(self.layers), self.num_experts)
        self.gate_seq, self.token_seq, self.gate_tok, self.token_tok = (p.reshape(shape) for p in parts[:4])
        self.counts = parts[4].clone()

    def scores(self, average: str = "sequence") -> dict[int, dict[str, torch.Tensor]]:
        """``{layer index: {"gate": float64 [E], "token": float64 [E]}}``."""
        _check_choice("average", average, AVERAGES)
        if self.sequences == 0:
            raise ValueError("ESFT scores need at least one sequence with a real (attention_mask=1) token")
        if average == "sequence":
            gate, token, n = self.gate_seq, self.token_seq, self.counts[0]
        else:
            gate, token, n = self.gate_tok, self.token_tok, self.counts[1]
        return {layer: {"gate": gate[i] / n, "token": token[i] / n} for i, layer in enumerate(self.layers)}


def esft_statistics(model, batches: Iterable[Mapping], max_batches: int | None = None) -> ESFTStatistics:
    """Run the routing-statistics pass behind :func:`esft_scores` and return its sums.

    Eval mode, no gradients, with the model's installed moe-lab routing (an unpatched HF model is patched
    for the pass with conventional routing and restored afterwards). ``batches``: dicts with
    ``input_ids`` [B, S] and optionally ``attention_mask`` [B, S] (pad tokens = 0 are excluded; sequences
    with no real token are skipped). ``max_batches`` stops after that many batches.
    """
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    temporary = None
    if not blocks:
        temporary = MoEPatch(model, method="sft")
        blocks = temporary.layers
    blocks = sorted(blocks, key=lambda b: b.index)
    stats = ESFTStatistics([b.index for b in blocks], blocks[0].num_experts)
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [_capture_routing(block, captured, i) for i, block in enumerate(blocks)]
    was_training = model.training
    device = next(model.parameters()).device
    try:
        model.eval()
        with torch.no_grad():
            for n_batch, batch in enumerate(batches):
                if max_batches is not None and n_batch >= max_batches:
                    break
                ids = _field(batch, "input_ids", n_batch).to(device)
                mask = batch.get("attention_mask")
                mask = torch.ones_like(ids) if mask is None else mask.to(device)
                if mask.shape != ids.shape:
                    raise ValueError(f"batch {n_batch}: attention_mask shape {tuple(mask.shape)} != input_ids "
                                     f"shape {tuple(ids.shape)}")
                captured.clear()
                model(input_ids=ids, attention_mask=mask, use_cache=False)
                _accumulate(stats, blocks, captured, mask.bool())
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
        if temporary is not None:
            temporary.remove()
    return stats


def esft_scores(model, batches: Iterable[Mapping], max_batches: int | None = None,
                average: str = "sequence") -> dict[int, dict[str, torch.Tensor]]:
    """ESFT expert scores of every MoE layer: ``{layer index: {"gate": [E], "token": [E]}}`` (float64).

    gate = mean over tokens of the expert's top-k gate weight (0 when not selected; the weight the router
    applies, divided by the family's routed scaling factor), token = mean over tokens of 1[selected]/K.
    ``average="sequence"`` (the paper): mean over each sequence's real tokens, then over sequences;
    ``average="token"`` (the public scoring script): mean over all real tokens. See
    :func:`esft_statistics` for ``batches``/``max_batches``.
    """
    _check_choice("average", average, AVERAGES)
    return esft_statistics(model, batches, max_batches).scores(average)


def _field(batch: Mapping, name: str, n_batch: int) -> torch.Tensor:
    if not isinstance(batch, Mapping) or name not in batch:
        raise ValueError(f"batch {n_batch}: expected a dict with {name!r} (and optionally 'attention_mask')")
    value = batch[name]
    if not torch.is_tensor(value) or value.dim() != 2:
        raise ValueError(f"batch {n_batch}: {name} must be a 2-D tensor [batch, seq]")
    return value


def _capture_routing(block: MoEBlock, captured: dict, slot: int):
    def hook(module, args, output):
        _, weights, indices = split_router_output(block.spec, output)
        captured[slot] = (weights.detach(), indices.detach())

    return block.view.obj.router.register_forward_hook(hook)


def _accumulate(stats: ESFTStatistics, blocks: list[MoEBlock], captured: dict, mask: torch.Tensor) -> None:
    batch, seq = mask.shape
    real = mask.to(torch.float64).cpu()  # [B, S]
    per_seq = real.sum(dim=1)
    has_tokens = per_seq > 0
    for i, block in enumerate(blocks):
        if i not in captured:
            raise RuntimeError(f"MoE layer {block.index} did not route during the ESFT scoring pass")
        weights, indices = captured[i]
        view = block.view.obj
        k, n_exp = indices.shape[1], block.num_experts
        weights = weights.to("cpu", torch.float64) / view.rule.scaling
        indices = indices.cpu()
        gate = torch.zeros(batch * seq, n_exp, dtype=torch.float64).scatter_add_(1, indices, weights)
        token = torch.zeros(batch * seq, n_exp, dtype=torch.float64).scatter_add_(
            1, indices, torch.full(indices.shape, 1.0 / k, dtype=torch.float64))
        gate = gate.view(batch, seq, n_exp) * real[..., None]
        token = token.view(batch, seq, n_exp) * real[..., None]
        denom = per_seq.clamp_min(1.0)[:, None]
        stats.gate_seq[i] += (gate.sum(1) / denom)[has_tokens].sum(0)
        stats.token_seq[i] += (token.sum(1) / denom)[has_tokens].sum(0)
        stats.gate_tok[i] += gate.sum((0, 1))
        stats.token_tok[i] += token.sum((0, 1))
    stats.counts += torch.tensor([float(has_tokens.sum()), float(real.sum())], dtype=torch.float64)


# selection ---------------------------------------------------------------------------------------
def esft_select(scores: Mapping, p: float, score: str = "token", normalize: bool = False) -> dict[int, list[int]]:
    """Experts to train per layer: ``{layer index: sorted expert ids}``.

    Per layer, experts are taken by descending score (ties: lower expert id first) until the cumulative
    score reaches ``p`` (within 1e-9); the expert that crosses ``p`` is included. If the layer's total
    score stays below ``p``, every expert of the layer is selected. ``normalize=True`` first divides each
    layer's scores by their sum (as the public ESFT script does), so ``p`` is a fraction of the total.
    ``scores``: the output of :func:`esft_scores` or its JSON form (string layer keys, lists).
    """
    _check_choice("score", score, SCORES)
    if not (isinstance(p, (int, float)) and math.isfinite(p) and p > 0):
        raise ValueError(f"p={p!r}: the ESFT threshold must be a number > 0 (the paper uses 0.1-0.2)")
    selection = {}
    for layer, entry in scores.items():
        if not isinstance(entry, Mapping) or score not in entry:
            raise ValueError(f"scores[{layer!r}] has no {score!r} scores")
        values = [float(v) for v in (entry[score].tolist() if torch.is_tensor(entry[score]) else entry[score])]
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise ValueError(f"scores[{layer!r}][{score!r}] must be finite and >= 0")
        if normalize:
            total = sum(values)
            values = [v / total for v in values] if total > 0 else values
        order = sorted(range(len(values)), key=lambda e: (-values[e], e))
        chosen, cumulative = [], 0.0
        for e in order:
            chosen.append(e)
            cumulative += values[e]
            if cumulative >= p - _REACH_TOLERANCE:
                break
        selection[int(layer)] = sorted(chosen)
    return selection


# installation ------------------------------------------------------------------------------------
def plan_lines(cfg, length: dict | None) -> list[str]:
    """Where the trained experts come from, and when ESFT scores them (``plan=true``)."""
    c = cfg.method
    if c.get("selection_file") or c.get("scores_file"):
        return [f"ESFT experts: from {c.get('selection_file') or c.get('scores_file')} at the start"]
    return [(f"ESFT scoring ({c.score}, p {c.p}): a routing-statistics pass over the first {c.score_batches} training "
            "micro-batches at fit start, before step 1")]


@register_method("esft", expert_parallel=True, cost_row="esft", refused_strategies=("fsdp",), plan_lines=plan_lines,
                 own_experts_pass="ESFT's trained-slices pass")
def install_esft(
    patch: MoEPatch,
    experts: Mapping | None = None,
    train_router: bool = False,
    train_attention: bool = False,
    train_shared_experts: bool = False,
    train_embeddings: bool = False,
    train_lm_head: bool = False,
    train_norms: bool = False,
    train_dense_mlp: bool = False,
) -> None:
    """Train only ``experts[layer index]`` (a list of routed-expert ids) in each MoE layer.

    Everything else is frozen unless its flag is set: ``train_router`` (router weights and GPT-OSS router
    bias), ``train_attention``, ``train_shared_experts`` (with Qwen2-MoE's shared-expert gate),
    ``train_embeddings`` (input embeddings), ``train_lm_head``, ``train_norms`` and ``train_dense_mlp``
    (MLPs of dense decoder layers, and any parameter of no other group). Tied input/output embeddings
    train if either of their flags is set. A layer missing from ``experts`` trains no routed expert.
    """
    if experts is None:
        raise ValueError("esft needs experts={layer index: [expert ids]}: compute them with "
                         "moe_lab.esft_select(moe_lab.esft_scores(model, batches), p) or use method=esft_token / "
                         "esft_gate, which select at fit start")
    flags = {"router": train_router, "attention": train_attention, "shared_experts": train_shared_experts,
             "embeddings": train_embeddings, "lm_head": train_lm_head, "norms": train_norms,
             "dense_mlp": train_dense_mlp}
    for group, params in esft_parameter_groups(patch).items():
        if group == "experts":
            continue
        for _, param in params:
            param.requires_grad_(bool(flags[group]) or _tied_and_trained(param, patch, flags))
    select_experts(patch, experts)


def select_experts(patch: MoEPatch, experts: Mapping) -> dict[int, list[int]]:
    """Make ``experts`` (``{layer index: [ids]}``, int or str keys) the only trainable routed experts.

    Can be called once more on a patch installed with ``experts={}`` (how the ESFT Lightning module
    installs a selection computed at fit start). Returns the normalised selection.
    """
    selection = normalize_selection(experts)
    if patch.expert_slice_masks or getattr(patch, "_esft_selected", False):
        raise RuntimeError("an ESFT selection is already installed on this patch; install a new patch instead")
    for view in patch.views:
        trained = bool(selection.get(view.index))
        for param in view.experts.parameters():
            param.requires_grad_(trained)
    patch.restrict_expert_training(selection)
    patch._esft_selected = bool(selection)
    for view, block in zip(patch.views, patch.layers):
        ids = selection.get(view.index, [])
        # input-scaled experts (registry weight_on_input) run as HF's dense bmm over every expert: no frozen-pair
        # saving there; the slice hooks alone keep the frozen experts' gradients zero
        if ids and len(ids) < view.num_experts and not view.spec.weight_on_input:
            trained = torch.zeros(view.num_experts, dtype=torch.bool)
            trained[ids] = True
            block.mixer = FrozenExpertsMixture(trained)
    if patch.expert_slice_masks:
        guard = FrozenSliceGuard(patch.expert_slice_masks.values())
        patch.frozen_slice_guard = guard
        for block in patch.layers:  # the model owns it: it lives as long as the blocks, patch kept or not
            block.frozen_slice_guard = guard
    return selection


# frozen experts cost no weight gradient -----------------------------------------------------------------
class FrozenExpertsMixture:
    """``MoEBlock.mixer`` of ESFT: the conventional top-k mixture, with the (token, expert) pairs of frozen
    experts multiplied by DETACHED expert weights, so backward computes weight gradients only for the
    trained experts' pairs (input gradients for all). Mirrors HF's ``grouped_mm`` experts forward: pairs
    sorted by expert, per-expert grouped matmuls, routing weights, then a sum over the top-k slots; each
    expert's rows are those of the joint call, in the same order. Experts stored as row blocks (DBRX): HF's own
    per-expert loop (:func:`~moe_lab.moe.experts.looped_mixture`), frozen experts on detached views. ``trained``:
    bool [E]."""

    def __init__(self, trained: torch.Tensor):
        self.trained = trained

    def __call__(self, block: MoEBlock, x, logits, weights, indices):
        experts, view = block.experts, block.view.obj
        if (not torch.is_grad_enabled() or parametrize.is_parametrized(view.expert_module) or indices.numel() == 0
                or hasattr(experts, "moe_lab_expert_parallel")):
            # no backward, LoRA (its adapters train), no tokens, or experts dispatched to their EP owners (whose
            # gradient hooks zero the frozen slices)
            return sparse_mixture(block, x, logits, weights, indices)
        if not view.layout.packed:  # row-blocked experts (DBRX): HF's own per-expert loop, frozen ones detached
            return looped_mixture(view, x, indices, weights, frozen=~self.trained)
        transposed, _, has_bias = packed_layout(view)
        k, n_experts = indices.shape[1], view.num_experts
        expert_ids, perm = torch.sort(indices.reshape(-1))
        trained = self.trained.to(expert_ids.device)[expert_ids]
        split = int(trained.sum())
        order = torch.cat([trained.nonzero().squeeze(-1), (~trained).nonzero().squeeze(-1)])
        perm, expert_ids = perm[order], expert_ids[order]
        rows = x[perm // k]
        parts = []
        for part, detach in ((slice(0, split), False), (slice(split, None), True)):
            ids = expert_ids[part]
            if ids.numel() == 0:
                continue
            tensors = [experts.gate_up_proj, experts.down_proj]
            biases = [experts.gate_up_proj_bias, experts.down_proj_bias] if has_bias else [None, None]
            if detach:
                tensors = [t.detach() for t in tensors]
                biases = [None if b is None else b.detach() for b in biases]
            offsets = torch.cumsum(torch.bincount(ids, minlength=n_experts), dim=0).to(torch.int32)
            hidden = _grouped_linear(rows[part], tensors[0], offsets, is_transposed=transposed,
                                     bias=None if biases[0] is None else biases[0][ids])
            hidden = experts._apply_gate(hidden)
            parts.append(_grouped_linear(hidden, tensors[1], offsets, is_transposed=transposed,
                                         bias=None if biases[1] is None else biases[1][ids]))
        out = torch.cat(parts) * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return out[inverse].view(x.shape[0], k, -1).sum(dim=1).to(x.dtype)


# frozen slices under any optimizer -----------------------------------------------------------------
# optimizers whose step leaves an entry with zero gradient (and so zero state) exactly unchanged when its
# param group has weight_decay == 0 (checked against torch's implementations: every update is a multiple of
# the gradient or of state built from it). Any other optimizer (ASGD decays every entry, Muon
# orthogonalises whole matrices, ...) or any non-zero weight decay gets the copy/restore.
_EXACT_AT_ZERO_DECAY = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
                        torch.optim.Adamax, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
                        torch.optim.Rprop)
_GUARDS: weakref.WeakSet = weakref.WeakSet()
_HOOKS: list = []


class FrozenSliceGuard:
    """Keeps the untrained expert slices of packed tensors bit-identical across every optimizer step.

    Registered in torch's GLOBAL optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``
    / ``_post_hook``), so it covers optimizers built anywhere, after or before ``moe_lab.apply``. Before a step
    it copies the frozen slices of each masked tensor the optimizer holds, unless that tensor's param group
    has ``weight_decay == 0`` and the optimizer is one of ``_EXACT_AT_ZERO_DECAY`` (zero gradient -> no
    change, exactly; the moe-lab Lightning module puts masked tensors in such a group and decays their trained
    slices itself, so it pays no copy); after the step it writes them back. Cost where it copies: one copy
    of the frozen slices per step (memory and bandwidth). Lives as long as the MoE blocks that hold it.
    """

    def __init__(self, slices):
        self.slices = [(param, mask) for param, mask in slices]
        self._saved: dict[int, list] = {}
        self._register()

    def _register(self) -> None:
        _GUARDS.add(self)
        if not _HOOKS:
            _HOOKS.extend([register_optimizer_step_pre_hook(_save_frozen_slices),
                           register_optimizer_step_post_hook(_restore_frozen_slices)])

    def __getstate__(self):
        return {"slices": self.slices}

    def __setstate__(self, state):  # unpickled (ddp_spawn, torch.save): register in this process
        self.slices, self._saved = state["slices"], {}
        self._register()

    def save(self, optimizer: torch.optim.Optimizer) -> None:
        groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        saved = []
        for param, mask in self.slices:
            group = groups.get(id(param))
            if group is None or (type(optimizer) in _EXACT_AT_ZERO_DECAY and not group.get("weight_decay", 1.0)):
                continue
            frozen = (~mask).nonzero().squeeze(-1).to(param.device)
            saved.append((param, frozen, param.detach().index_select(0, frozen)))
        self._saved[id(optimizer)] = saved

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for param, frozen, values in self._saved.pop(id(optimizer), []):
                param.index_copy_(0, frozen, values)


def _save_frozen_slices(optimizer, args, kwargs) -> None:
    for guard in list(_GUARDS):
        guard.save(optimizer)


def _restore_frozen_slices(optimizer, args, kwargs) -> None:
    for guard in list(_GUARDS):
        guard.restore(optimizer)


def slice_optimizer(optimizer: torch.optim.Optimizer, patch: MoEPatch) -> int:
    """Make ``optimizer`` step only the trained expert slices of ESFT's packed expert tensors.

    Each packed tensor of ``patch.expert_slice_masks`` in ``optimizer``'s param groups is replaced, in its
    group, by leaf views of its runs of trained experts (sharing its storage); a post-accumulate-grad hook
    hands them the matching slices of its gradient, and a step post-hook drops that gradient once stepped
    (callers zero gradients after each step anyway). The frozen slices then cost no optimizer arithmetic
    (torch steps the whole tensor otherwise, zero gradients included), and results are bit-identical: only
    for the element-wise optimizers of ``_EXACT_AT_ZERO_DECAY``, and only for tensors without optimizer
    state yet (call it on a fresh optimizer); others are left as they are. Returns the tensors sliced."""
    if type(optimizer) not in _EXACT_AT_ZERO_DECAY:
        return 0
    masks = {id(param): mask for param, mask in patch.expert_slice_masks.values()}
    links = []
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            if id(param) not in masks or optimizer.state.get(param):
                params.append(param)
                continue
            runs = trained_runs(masks[id(param)])
            views = [param.detach()[start:stop].requires_grad_() for start, stop in runs]
            params.extend(views)
            links.append(param)
            param.register_post_accumulate_grad_hook(_GradientSlices(runs, views))
        group["params"] = params
    if links:
        optimizer.register_step_post_hook(_DropGradients(links))
    return len(links)


class _GradientSlices:
    """Post-accumulate-grad hook: the optimizer's slice views get the matching slices of the gradient."""

    def __init__(self, runs, views):
        self.runs, self.views = runs, views

    def __call__(self, param: torch.Tensor) -> None:
        if self.views[0].untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
            raise RuntimeError("ESFT: a packed expert tensor got new storage (e.g. model.to() or a dtype change) after "
                               "slice_optimizer: build the optimizer after moving/casting the model")
        for (start, stop), view in zip(self.runs, self.views):
            view.grad = param.grad[start:stop]


class _DropGradients:
    """Step post-hook: drop the packed tensors' gradients (their views' were consumed by the step)."""

    def __init__(self, params):
        self.params = params

    def __call__(self, optimizer, args, kwargs) -> None:
        for param in self.params:
            param.grad = None


def normalize_selection(experts: Mapping) -> dict[int, list[int]]:
    """``{int layer: sorted unique int ids}`` from a selection with int or str keys (e.g. read from JSON)."""
    if not isinstance(experts, Mapping):
        raise TypeError(f"experts must be a dict {{layer index: [expert ids]}}, got {type(experts).__name__}")
    out = {}
    for layer, ids in experts.items():
        try:
            index = int(layer)
            out[index] = sorted({int(e) for e in ids})
        except (TypeError, ValueError):
            raise ValueError(f"experts[{layer!r}]={ids!r}: need an integer layer index and a list of integer "
                             "expert ids") from None
    return out


def esft_parameter_groups(patch: MoEPatch) -> dict[str, list]:
    """``patch.parameter_groups()`` refined for ESFT's flags: router, experts, shared_experts, attention,
    embeddings (input), lm_head, norms and dense_mlp (every remaining parameter)."""
    groups = patch.parameter_groups()
    output_embedding = patch.model.get_output_embeddings()
    lm_head = {id(p) for p in output_embedding.parameters()} if output_embedding is not None else set()
    refined = {name: list(groups[name]) for name in ("router", "experts", "shared_experts", "attention")}
    refined["embeddings"] = [(n, p) for n, p in groups["embeddings"] if id(p) not in lm_head]
    refined["lm_head"] = [(n, p) for n, p in groups["embeddings"] if id(p) in lm_head]
    refined["norms"] = [(n, p) for n, p in groups["other"] if "norm" in n.rsplit(".", 2)[-2]]
    refined["dense_mlp"] = [(n, p) for n, p in groups["other"] if "norm" not in n.rsplit(".", 2)[-2]]
    return refined


def _tied_and_trained(param, patch: MoEPatch, flags: dict) -> bool:
    inp, out = patch.model.get_input_embeddings(), patch.model.get_output_embeddings()
    if inp is None or out is None or inp.weight is not out.weight or param is not inp.weight:
        return False
    return bool(flags["embeddings"] or flags["lm_head"])


# JSON artifact -----------------------------------------------------------------------------------
def save_selection(path: str | Path, experts: Mapping | None = None, scores: Mapping | None = None,
                   **info) -> Path:
    """Write ``{"experts": {layer: ids}, "scores": {layer: {"gate": [...], "token": [...]}}, **info}``.

    Floats are written exactly (JSON float repr), so :func:`load_selection` round-trips them.
    """
    payload = dict(info)
    if experts is not None:
        payload["experts"] = {str(k): list(v) for k, v in normalize_selection(experts).items()}
    if scores is not None:
        payload["scores"] = {
            str(int(layer)): {name: [float(v) for v in (vals.tolist() if torch.is_tensor(vals) else vals)]
                              for name, vals in entry.items()}
            for layer, entry in scores.items()
        }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)
    return path


def load_selection(path: str | Path) -> dict:
    """Read an ESFT JSON file (:func:`save_selection`'s format, or the public ESFT ``expert_cfg.json``
    ``{"experts": {"<layer>": [ids]}, ...}``). Returns its dict with ``experts`` as ``{int: [int]}`` and
    ``scores`` as ``{int: {"gate": float64 tensor, "token": float64 tensor}}`` when present."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"ESFT selection file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"ESFT selection file {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(payload, dict) or not ({"experts", "scores"} & set(payload)):
        raise ValueError(f"ESFT selection file {str(path)!r} has neither 'experts' nor 'scores'")
    if "experts" in payload:
        payload["experts"] = normalize_selection(payload["experts"])
    if "scores" in payload:
        try:
            payload["scores"] = {int(layer): {name: torch.tensor(vals, dtype=torch.float64)
                                              for name, vals in entry.items()}
                                 for layer, entry in payload["scores"].items()}
        except (TypeError, ValueError, AttributeError):
            raise ValueError(f"ESFT selection file {str(path)!r}: 'scores' must map layer -> "
                             "{'gate': [...], 'token': [...]}") from None
    return payload


def _check_choice(field_name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{field_name}={value!r} is not one of {', '.join(map(repr, allowed))}")


@register_cost_row("esft", order=50)
def esft_costs(ctx: CostContext) -> dict:
    """The estimate's row: frozen weights skip their weight gradients; a share of the assignments hits a
    trained expert (``esft_assignment_share``), a share of the routed experts trains
    (``esft_expert_share``)."""
    share = ctx.opts.esft_assignment_share
    return ctx.row(
        ctx.sft_f, ctx.b_frozen + ctx.experts(lambda s: s.top_k) + share * ctx.experts(lambda s: s.top_k),
        ctx.opts.esft_expert_share * ctx.counts.routed, ctx.assign_k,
        note=f"frozen weights skip their weight gradients; {share:.0%} of assignments hit trained experts")
