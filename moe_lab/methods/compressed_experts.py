"""Compressed Experts (He, Liu, Liang, Awadalla 2025, "Efficiently Editing Mixture-of-Experts Models with
Compressed Experts", arXiv:2503.00634; public code: OlmoeSparseCompressedMoeBlock in the Compressed-Experts
repository).

Each token's top-k experts are split by router weight into k_m *main* experts (the largest weights; default
k_m = k/2) and k_a = k - k_m *auxiliary* experts. The routing policy returns only the main experts, so the
layer's routing counts / expert-load statistics count only the experts that run; the auxiliary experts are
never executed. Every routed expert e owns trainable vectors, initialised to ones when the method is
installed (after loading). The auxiliary experts' vectors, averaged with their router weights renormalised
over the auxiliary set (a_j = w_j / sum_aux w), rescale the main experts. Two forms (``form``):

- ``"input"`` (default; the paper's section 2.2): one hidden-size vector per expert on the expert input,
  H parameters per expert::

      u = sum_j a_j input_scale[j]
      y = sum_{i in main} w_i * E_i(x * u)                                          (+ shared experts)

- ``"gate_up_intermediate"`` (the paper's section 2.4 and the public code): three vectors per expert, on
  the gate-projection input (H), the up-projection input (H) and the intermediate activation (I), 2H + I
  parameters per expert::

      y = sum_{i in main} w_i * W_down_i( act(W_gate_i (x*u_gate)) * W_up_i (x*u_up) * s )

Main experts keep their original router weights w_i (no renormalisation over the main set, as in the
public code); with ``main_weights="renormalized"`` they are rescaled to carry the whole top-k mass,
w_i * sum_topk w / sum_main w. At initialisation the layer therefore equals top-k_m routing with the
family's own top-k weights.

``full_finetune=True`` (default; the paper and the public code fine-tune the whole model with the vectors)
or ``False``: only the vectors train. The vectors are one 1-D parameter per expert, so the Lightning module
puts them in the no-weight-decay group like norm gains.

Export: ``patch.export`` writes the vanilla HF checkpoint (vanilla transformers cannot represent
compressed experts: it runs plain top-k routing) plus ``moe_lab_compressed_experts.safetensors`` and
``moe_lab_compressed_experts.json``; :func:`load_compressed_experts` reinstalls them.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
from torch import nn
from transformers.integrations.moe import _grouped_linear

from ..analysis.estimate import CostContext, register_cost_row
from ..moe.block import ConventionalRouting, MoEBlock
from ..moe.experts import expert_intermediate_size, expert_mixture, looped_mixture
from ..moe.patch import MoEPatch
from ..moe.support import output_weighted
from ..moe.view import MoELayerView
from .registry import apply, method_spec, register_export_loader, register_method

log = logging.getLogger(__name__)

FORMS = ("input", "gate_up_intermediate")
MAIN_WEIGHTS = ("original", "renormalized")
VECTORS_FILE = "moe_lab_compressed_experts.safetensors"
CONFIG_FILE = "moe_lab_compressed_experts.json"
NOT_VANILLA = ("vanilla transformers cannot represent compressed experts: from_pretrained on this directory "
               "routes every token to its full top-k experts; load it with "
               "moe_lab.methods.compressed_experts.load_compressed_experts(model, directory)")


class CompressedExpertVectors(nn.Module):
    """The per-expert vectors of one MoE layer: one 1-D parameter per expert and kind, ones at creation.

    ``form="input"``: ``input_scale`` [H]; ``"gate_up_intermediate"``: ``input_scale`` [H] (gate input),
    ``up_input_scale`` [H] and ``act_scale`` [I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, form: str, like: torch.Tensor):
        super().__init__()

        def ones(size: int) -> nn.ParameterList:
            return nn.ParameterList(
                [nn.Parameter(torch.ones(size, dtype=like.dtype, device=like.device)) for _ in range(num_experts)])

        three = form == "gate_up_intermediate"
        self.input_scale = ones(hidden)
        self.up_input_scale = ones(hidden) if three else None
        self.act_scale = ones(intermediate) if three else None

    def stacked(self) -> dict[str, torch.Tensor]:
        """``{"input_scale": [E, H](, "up_input_scale": [E, H], "act_scale": [E, I])}``."""
        kinds = {"input_scale": self.input_scale, "up_input_scale": self.up_input_scale,
                 "act_scale": self.act_scale}
        return {name: torch.stack(list(params)) for name, params in kinds.items() if params is not None}


class CompressedExpertsRouting(ConventionalRouting):
    """The family's routing, split: returns the k_main main experts (the ones that run and are counted as
    load) and keeps the auxiliary ones for the mixer of the same forward (:meth:`take_auxiliary`)."""

    def __init__(self, view: MoELayerView, k_main: int, main_weights: str):
        super().__init__(view)
        self.k_main = k_main
        self.main_weights = main_weights
        self.auxiliary = None

    def __call__(self, router: nn.Module, x: torch.Tensor):
        logits, weights, indices = super().__call__(router, x)
        main_w, main_idx, aux_w, aux_idx = self.split(weights, indices)
        self.auxiliary = (aux_w, aux_idx)
        return logits, main_w, main_idx

    def take_auxiliary(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux weights renormalised over the auxiliary set, aux ids)`` of the latest routing call."""
        if self.auxiliary is None:
            raise RuntimeError("compressed experts: the mixer ran without a routing call before it")
        auxiliary, self.auxiliary = self.auxiliary, None
        return auxiliary

    def split(self, weights: torch.Tensor, indices: torch.Tensor):
        """``(main weights, main ids, auxiliary weights renormalised over the auxiliary set, aux ids)``,
        main = the k_main largest router weights (ties: earlier top-k slot first)."""
        order = torch.argsort(weights, dim=-1, descending=True, stable=True)
        w, idx = weights.gather(1, order), indices.gather(1, order)
        k_m = self.k_main
        main_w, aux_w = w[:, :k_m], w[:, k_m:]
        if self.main_weights == "renormalized":
            main_total = main_w.sum(-1, keepdim=True)
            main_w = main_w * torch.where(main_total > 0, w.sum(-1, keepdim=True) / main_total, 1.0)
        aux_total = aux_w.sum(-1, keepdim=True)
        uniform = torch.full_like(aux_w, 1.0 / aux_w.shape[1])
        aux_norm = torch.where(aux_total > 0, aux_w / torch.where(aux_total > 0, aux_total, 1.0), uniform)
        return main_w, idx[:, :k_m], aux_norm, idx[:, k_m:]


class CompressedExpertsMixture:
    """``MoEBlock.mixer`` of Compressed Experts (see the module docstring): the main experts of the
    routing call, scaled by the auxiliary experts' averaged vectors."""

    def __call__(self, block: MoEBlock, x, logits, weights, indices):
        view = block.view.obj
        aux_w, aux_idx = view.router.moe_lab_policy.take_auxiliary()
        vectors = block.compressed_experts.stacked()
        dtype = vectors["input_scale"].dtype
        mix = torch.zeros(x.shape[0], block.num_experts, dtype=dtype, device=x.device)
        mix = mix.scatter_add(1, aux_idx, aux_w.to(dtype))  # [N, E] renormalised auxiliary weights
        scales = {name: mix @ v for name, v in vectors.items()}
        if hasattr(view.experts, "moe_lab_expert_parallel"):  # EP (form=input only): the dispatched experts call
            return expert_mixture(view, x * scales["input_scale"], weights, indices).to(x.dtype)
        return scaled_expert_mixture(view, x, indices, weights, scales)


def scaled_expert_mixture(view: MoELayerView, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                          scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """``sum_slot weights * E_indices(x * input_scale)`` with the intermediate activation times ``act_scale``.

    ``scales`` holds per-token rows: input_scale [N, H], optional up_input_scale [N, H] (then the gate
    projection sees ``x * input_scale`` and the up projection ``x * up_input_scale``), optional act_scale
    [N, I].
    Rows are sorted by expert once and every projection is one grouped matmul over slices of the packed
    tensors, dispatched like HF's default ``grouped_mm`` experts implementation (the kernel sft uses).
    """
    if not view.layout.packed:  # row-blocked experts (DBRX): HF's per-expert loop on the layout's views
        return looped_mixture(view, x, indices, weights, scales).to(x.dtype)
    experts = view.experts
    transposed, concatenated, has_bias = packed_layout(view)
    k = indices.shape[1]
    expert_ids, perm = torch.sort(indices.reshape(-1), stable=True)
    tokens = perm // k
    offsets = torch.cumsum(torch.bincount(expert_ids, minlength=view.num_experts), dim=0).to(torch.int32)
    gate_in = (x * scales["input_scale"])[tokens]
    gate_up, bias = experts.gate_up_proj, experts.gate_up_proj_bias[expert_ids] if has_bias else None
    if "up_input_scale" not in scales:
        projected = _grouped_linear(gate_in, gate_up, offsets, bias=bias, is_transposed=transposed)
    else:
        up_in = (x * scales["up_input_scale"])[tokens]
        (w_gate, w_up), (b_gate, b_up) = _split_gate_up(gate_up, bias, transposed, concatenated)
        gate = _grouped_linear(gate_in, w_gate, offsets, bias=b_gate, is_transposed=transposed)
        up = _grouped_linear(up_in, w_up, offsets, bias=b_up, is_transposed=transposed)
        if concatenated:
            projected = torch.cat((gate, up), dim=-1)
        else:  # interleave; grouped_mm's backward needs the (strided) column gradients made contiguous
            for part in (gate, up):
                if part.requires_grad:
                    part.register_hook(torch.Tensor.contiguous)
            projected = torch.stack((gate, up), dim=-1).flatten(-2)
    hidden = experts._apply_gate(projected)
    if "act_scale" in scales:
        hidden = hidden * scales["act_scale"][tokens]
    bias = experts.down_proj_bias[expert_ids] if has_bias else None
    out = _grouped_linear(hidden, experts.down_proj, offsets, bias=bias, is_transposed=transposed)
    out = out * weights.reshape(-1)[perm, None]
    # back to (token, slot) order, then a sum over the slots (as HF's grouped experts do)
    out = out.new_empty(out.shape).index_copy(0, perm, out)
    return out.view(-1, k, out.shape[-1]).sum(dim=1).to(x.dtype)


def packed_layout(view: MoELayerView) -> tuple[bool, bool, bool]:
    """(weights stored [E, in, out], gate/up concatenated (else interleaved), expert biases) of the packed
    experts, as HF's experts-implementation decorator records them (the registry's layout otherwise)."""
    experts, layout = view.experts, view.layout
    return (bool(getattr(experts, "is_transposed", layout.transposed)),
            bool(getattr(experts, "is_concatenated", not layout.interleaved)),
            bool(getattr(experts, "has_bias", layout.biases)))


def _split_gate_up(weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool, concatenated: bool):
    """((gate weights, up weights), (gate bias, up bias)): views of the packed gate_up tensor and its bias."""
    dim = 2 if transposed else 1
    size = weight.shape[dim] // 2
    if concatenated:
        parts = (weight.narrow(dim, 0, size), weight.narrow(dim, size, size))
        biases = (None, None) if bias is None else (bias[..., :size], bias[..., size:])
    else:
        # interleaved columns: grouped_mm needs unit-stride rows, so these two are copied (autograd-tracked)
        parts = (weight[:, :, ::2], weight[:, :, 1::2]) if transposed else (weight[:, ::2], weight[:, 1::2])
        parts = tuple(part.contiguous() for part in parts)
        biases = (None, None) if bias is None else (bias[..., ::2], bias[..., 1::2])
    return parts, biases


def default_k_main(top_k: int) -> int:
    """k_m = k // 2 (the paper's setting: half of the activated experts are compressed)."""
    return top_k // 2


@register_method(
    "compressed_experts", expert_parallel=True, cost_row="compressed_experts",
    own_experts_pass="Compressed Experts' scaled pass",
    undefined_for=output_weighted(
        "Compressed Experts' mixture is sum_main w_i E_i(x * u), the router weight on the main experts' outputs and "
        "the auxiliary vectors on their input (and a top-1 router has no auxiliary expert at all)"))
def install_compressed_experts(
    patch: MoEPatch,
    k_main: int | None = None,
    full_finetune: bool = True,
    form: str = "input",
    main_weights: str = "original",
) -> None:
    """Install Compressed Experts on every MoE layer (options in the module docstring).

    ``k_main``: main experts per token (default top_k // 2; 1 <= k_main < top_k). ``form``: "input" (one
    hidden-size vector per expert, the paper's section 2.2) or "gate_up_intermediate" (three vectors, its
    section 2.4 and the public code). ``full_finetune``: train the whole model with the vectors (True) or
    only the vectors (False).
    """
    if form not in FORMS:
        raise ValueError(f"method.options.form={form!r} is not one of {FORMS}")
    if main_weights not in MAIN_WEIGHTS:
        raise ValueError(f"method.options.main_weights={main_weights!r} is not one of {MAIN_WEIGHTS}")
    method_spec("compressed_experts").refuse_undefined(patch.spec, patch.views[0].rule)
    top_k = patch.layers[0].top_k
    if top_k < 2:
        raise ValueError(f"compressed_experts needs top_k >= 2 (main + auxiliary experts); this model has "
                         f"top_k={top_k}")
    k_main = default_k_main(top_k) if k_main is None else k_main
    if isinstance(k_main, bool) or not (isinstance(k_main, int) and 1 <= k_main < top_k):
        raise ValueError(f"method.options.k_main={k_main!r} must be an integer in [1, {top_k - 1}] (top_k={top_k}: "
                         "at least one main and one auxiliary expert); null = top_k // 2")
    if not full_finetune:
        for param in patch.model.parameters():
            param.requires_grad_(False)
    mixture = CompressedExpertsMixture()
    for view, block in zip(patch.views, patch.layers):
        block.compressed_experts = CompressedExpertVectors(
            block.num_experts, view.config.hidden_size, expert_intermediate_size(view), form, like=view.down_proj)
        view.router.moe_lab_policy = CompressedExpertsRouting(view, k_main, main_weights)
        block.mixer = mixture
    options = {"k_main": k_main, "full_finetune": bool(full_finetune), "form": form, "main_weights": main_weights}
    patch.export_hooks.append(functools.partial(_save_beside_export, patch, options))


# export / load --------------------------------------------------------------------------------------
def compressed_expert_state(patch: MoEPatch) -> dict[str, torch.Tensor]:
    """``{"layers.<index>.<kind>": [E, size]}`` for every MoE layer (contiguous CPU copies)."""
    state = {}
    for block in patch.layers:
        for name, tensor in block.compressed_experts.stacked().items():
            state[f"layers.{block.index}.{name}"] = tensor.detach().to("cpu").contiguous()
    return state


def save_compressed_experts(patch: MoEPatch, directory: str | Path, options: dict) -> None:
    """Write the vectors and the method options beside an export (called by ``patch.export``)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    save_file(compressed_expert_state(patch), str(directory / VECTORS_FILE), metadata={"format": "pt"})
    config = {"method": "compressed_experts", "options": options, "moe_layers": [b.index for b in patch.layers],
              "note": NOT_VANILLA}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    log.warning("compressed_experts export: %s", NOT_VANILLA)


def _save_beside_export(patch: MoEPatch, options: dict, directory) -> None:
    save_compressed_experts(patch, directory, options)


@register_export_loader(CONFIG_FILE)
def load_compressed_experts(model: nn.Module, directory: str | Path) -> MoEPatch:
    """Install compressed experts on ``model`` (loaded from an export) with the vectors saved there."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, vectors_path = directory / CONFIG_FILE, directory / VECTORS_FILE
    if not config_path.exists() or not vectors_path.exists():
        raise FileNotFoundError(f"{str(directory)!r} has no {CONFIG_FILE} / {VECTORS_FILE}: it was not exported "
                                "from a compressed_experts run")
    config = json.loads(config_path.read_text())
    if "input_scaling" in config["options"]:
        raise ValueError(f"{config_path} was written before the two paper forms (option input_scaling, H + I "
                         "vectors, neither form): re-export it from a run with method.options.form")
    patch = apply(model, "compressed_experts", **config["options"])
    state = load_file(str(vectors_path))
    expected = compressed_expert_state(patch)
    if set(state) != set(expected):
        raise ValueError(f"{vectors_path}: vectors for {sorted(set(state) ^ set(expected))[:4]} do not match this "
                         "model's MoE layers; it was saved from another model")
    with torch.no_grad():
        for block in patch.layers:
            for name, params in (("input_scale", block.compressed_experts.input_scale),
                                 ("up_input_scale", block.compressed_experts.up_input_scale),
                                 ("act_scale", block.compressed_experts.act_scale)):
                if params is None:
                    continue
                saved = state[f"layers.{block.index}.{name}"]
                if saved.shape != expected[f"layers.{block.index}.{name}"].shape:
                    raise ValueError(f"{vectors_path}: layers.{block.index}.{name} has shape {tuple(saved.shape)}, "
                                     f"expected {tuple(expected[f'layers.{block.index}.{name}'].shape)}")
                for e, param in enumerate(params):
                    param.copy_(saved[e])
    return patch


# cost --------------------------------------------------------------------------------------------------
def flop_ratio(patch: MoEPatch, k_main: int | None = None) -> float:
    """Analytic per-token FLOP ratio of a compressed-experts step to a conventional (sft) step.

    2 FLOPs per active parameter per token (forward; backward scales both alike): non-embedding,
    non-routed parameters (attention, router, shared experts, dense MLPs, lm_head) plus k (sft) or k_main
    (compressed) routed experts per MoE layer, plus the auxiliary-vector mixing (2 E V per layer, V the
    vector entries of one expert: H or 2H + I) and elementwise scalings (k_main V). Attention-score FLOPs
    (sequence-length dependent) are left out of both.
    """
    top_k = patch.layers[0].top_k
    k_main = k_main or _installed_k_main(patch) or default_k_main(top_k)
    input_embeddings = {id(p) for p in patch.model.get_input_embeddings().parameters()}
    routed = {id(p) for v in patch.views for p in v.experts.parameters()}
    vectors = {id(p) for b in patch.layers if hasattr(b, "compressed_experts")
               for p in b.compressed_experts.parameters()}
    dense = sum(p.numel() for p in patch.model.parameters()
                if id(p) not in input_embeddings | routed | vectors)
    sft = 2 * dense
    compressed = 2 * dense
    for view, block in zip(patch.views, patch.layers):
        per_expert = sum(p[0].numel() for p in view.experts.parameters())
        if hasattr(block, "compressed_experts"):
            size = sum(v.shape[1] for v in block.compressed_experts.stacked().values())
        else:
            size = view.config.hidden_size  # the default form
        sft += 2 * top_k * per_expert
        compressed += 2 * k_main * per_expert + 2 * view.num_experts * size + k_main * size
    return compressed / sft


def _installed_k_main(patch: MoEPatch) -> int | None:
    policy = patch.views[0].router.moe_lab_policy
    return policy.k_main if isinstance(policy, CompressedExpertsRouting) else None


def _compressed_experts_costs(ctx: CostContext) -> dict:
    """Compressed Experts' row: ``k_main`` experts run (default k // 2), the others as scaling vectors."""
    counts, opts = ctx.counts, ctx.opts
    km = {s.layer: opts.k_main or s.top_k // 2 for s in counts.experts}
    for s in counts.experts:
        if not 1 <= km[s.layer] < s.top_k:
            raise ValueError(f"task.methods.k_main={opts.k_main} must be in 1..top_k-1 (top_k={s.top_k})")
    if opts.compressed_form not in ("input", "gate_up_intermediate"):
        raise ValueError(f"task.methods.compressed_form={opts.compressed_form!r}: choose input or "
                         "gate_up_intermediate")
    vec = sum(s.num_experts * (s.hidden if opts.compressed_form == "input" else 2 * s.hidden + s.width)
              for s in counts.experts)
    return ctx.row(
        ctx.f_rest + ctx.experts(lambda s: km[s.layer]), ctx.b_rest + 2 * ctx.experts(lambda s: km[s.layer]),
        counts.total + vec, sum(km.values()),
        note=f"k_main experts run ({opts.compressed_form} vectors: {vec:,} parameters)",
        active_top_k={i: v - (v - (opts.k_main or v // 2)) for i, v in ctx.k.items()})


@register_cost_row("compressed_experts", order=40)
def compressed_experts_costs(ctx: CostContext) -> dict | None:
    """The estimate's row; none on a top-1 router (unless ``k_main`` is given, which then refuses)."""
    if ctx.opts.k_main is not None or all(s.top_k >= 2 for s in ctx.counts.experts):
        return _compressed_experts_costs(ctx)
    # a top-1 router runs no auxiliary expert: Compressed Experts is undefined there (the method refuses)
    ctx.skip("compressed_experts", "a top-1 router has no auxiliary expert to compress")
    return None
