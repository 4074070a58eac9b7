"""Cost estimates without weights: FLOPs per token (forward, backward) for every fine-tuning method, total and
active parameters, and training memory per hardware strategy.

Non-expert costs (attention as causal fused attention, projections, router, shared experts, dense layers,
lm_head) are measured on the meta device (:mod:`.meta_costs`); routed experts are counted analytically from
their packed tensors: one expert on one token costs ``2 * m`` FLOPs forward (``m`` = its matmul weights), as
much again for the input gradient and again for the weight gradient.

This module holds the machinery and the ``sft`` row. Every other method's row (its formula, and how it is
priced: on the dense student, with a teacher's weights, at another top-k, with an inactive-experts pass) lives
in the method's own module in :mod:`moe_lab.methods`, registered with :func:`register_cost_row` on a function
of a :class:`CostContext`; :data:`COST_ROWS` (and :data:`METHODS`, its names) hold them once
``moe_lab.methods`` is imported, and :func:`estimate` refuses to run on the ``sft`` row alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.registration import register_once
from .meta_costs import Measured, ParamCounts, count_parameters, measure, meta_model, moe_views, quiet_init

log = logging.getLogger(__name__)

STRATEGIES = ("ddp", "zero2", "zero3", "zero3_offload", "fsdp", "ep", "ep_ddp")
MOMENT_BYTES = 8  # AdamW's two fp32 moments per trained parameter: what ZeRO-1 shards beside EP (``ep`` row)
PRICING = "_pricing"  # a row's internal key: its RowPricing, stripped before output


@dataclass
class Options:
    """Method knobs the estimate depends on (conf/task/estimate.yaml ``methods``)."""

    condenser_n: int = 2
    k_main: int | None = None  # null: k // 2
    compressed_form: str = "input"  # input: H per expert | gate_up_intermediate: 2H + I per expert
    esft_expert_share: float = 0.1  # fraction of routed experts ESFT trains
    esft_assignment_share: float = 0.2  # fraction of routed assignments that hit a trained expert (ESFT p)
    lora_rank: int = 8
    kd_teacher_top_k: int | None = None  # k' (null: k)


def expert_sum(counts: ParamCounts, per_layer) -> int:
    """Sum over MoE layers of ``per_layer(shape) * 2 * matmul params per expert`` (FLOPs per token)."""
    return int(sum(per_layer(s) * 2 * s.matmul_params_per_expert for s in counts.experts))


@dataclass(frozen=True)
class RowPricing:
    """How :func:`estimate` prices a row beyond its FLOPs (the row's ``_pricing`` entry, left out of the
    output)."""

    on_student: bool = False  # counts, activations and memory of the MoE -> dense student, not of the model
    teacher_params: int = 0  # a frozen teacher's weights held beside the trained model (KD)
    active_top_k: dict[int, int] | None = None  # MoE layer -> experts per token, for params_active (None: k)
    inactive_pass: bool = False  # every token also runs the experts outside its top-k (EP all-to-all volume)


@dataclass
class CostContext:
    """What a cost row's formula reads: the meta model, its parameter counts, the measured non-expert costs
    with the non-experts trained (``trained``) and frozen (``frozen``), the method knobs, the dense student
    (``(counts, measured)``, or None) and the SFT quantities the rows start from. Built by :meth:`build`."""

    model: torch.nn.Module
    counts: ParamCounts
    trained: Measured
    frozen: Measured
    opts: Options
    student: tuple[ParamCounts, Measured] | None
    f_rest: float  # non-expert FLOPs per token, forward (non-experts trained)
    b_rest: float  # ... backward
    b_frozen: float  # non-expert FLOPs per token, backward, non-experts frozen (no weight gradients)
    h: int  # hidden size
    k: dict[int, int]  # MoE layer -> top-k
    sft_f: float  # SFT's FLOPs per token, forward
    sft_b: float  # ... backward
    assign_k: int  # expert assignments per token saved for the backward under HF top-k routing

    @classmethod
    def build(cls, model, counts: ParamCounts, trained: Measured, frozen: Measured, opts: Options,
              student=None) -> CostContext:
        t = trained.tokens
        f_rest, b_rest = trained.total("forward") / t, trained.total("backward") / t
        b_frozen = frozen.total("backward") / t
        h = int(model.config.hidden_size)
        k = {s.layer: s.top_k for s in counts.experts}
        top_k = expert_sum(counts, lambda s: s.top_k)
        sft_f, sft_b = f_rest + top_k, b_rest + 2 * top_k
        return cls(model, counts, trained, frozen, opts, student, f_rest, b_rest, b_frozen, h, k, sft_f,
                   sft_b, sum(k.values()))

    def experts(self, n) -> int:
        """FLOPs of ``n(shape)`` experts per token in every MoE layer."""
        return expert_sum(self.counts, n)

    @staticmethod
    def row(fwd, bwd, trainable, assignments, extra_act=0.0, note="", *, on_student: bool = False,
            teacher_params: int = 0, active_top_k: dict[int, int] | None = None,
            inactive_pass: bool = False) -> dict:
        """One method's row: FLOPs per token, trainable parameters, expert assignments saved for the backward,
        extra activation elements per token and a note; the keywords say how it is priced
        (:class:`RowPricing`)."""
        return {"flops_per_token_forward": fwd, "flops_per_token_backward": bwd,
                "params_trainable": int(trainable), "expert_assignments_saved": assignments,
                "extra_activation_elems_per_token": extra_act, "note": note,
                PRICING: RowPricing(on_student, teacher_params, active_top_k, inactive_pass)}

    @staticmethod
    def skip(name: str, why: str) -> None:
        """Log why row ``name`` is left out (its row function then returns None)."""
        log.info(f"estimate: no {name} row ({why})")


#: row name -> ``row(ctx: CostContext) -> dict | None`` (None: it does not apply), in the estimate's order;
#: filled by :func:`register_cost_row` (the ``sft`` row here, every other method's in its module)
COST_ROWS: dict[str, Callable[[CostContext], dict | None]] = {}
_ORDER: dict[str, float] = {}  # row name -> its registered ``order``


def register_cost_row(name: str, order: float | None = None) -> Callable[[Callable], Callable]:
    """``@register_cost_row("densemixer", order=10)`` on ``row(ctx: CostContext) -> dict | None``: the
    estimate's row ``name`` (what a method's ``cost_row`` names). ``order`` places it among the rows (tables,
    JSON, :data:`METHODS`); rows without one follow, in registration order. A second, other function under
    ``name`` is refused."""
    store = register_once(COST_ROWS, name, "cost row")

    def register(fn: Callable) -> Callable:
        store(fn)  # refuses another function under ``name`` before its order is taken
        _ORDER[name] = math.inf if order is None else order
        return fn

    return register


def _ordered() -> list[tuple[str, Callable]]:
    """:data:`COST_ROWS` by their ``order`` (rows without one last, in registration order)."""
    return sorted(COST_ROWS.items(), key=lambda item: _ORDER.get(item[0], math.inf))  # stable


def __getattr__(name: str):
    """``METHODS``: the names of :data:`COST_ROWS`, in order (read when asked: method modules add rows)."""
    if name == "METHODS":
        return tuple(name for name, _ in _ordered())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@register_cost_row("sft", order=0)
def sft_costs(ctx: CostContext) -> dict:
    """HF routing, gradients through the top-k experts."""
    return ctx.row(ctx.sft_f, ctx.sft_b, ctx.counts.total, ctx.assign_k,
                   note="HF routing; gradients through the top-k")


def method_costs(model, counts: ParamCounts, trained, frozen, opts: Options, student=None) -> dict[str, dict]:
    """Per-token FLOPs (forward / backward), trainable parameters and expert activations per method: every row
    of :data:`COST_ROWS` that applies, in order (each with its :class:`RowPricing` under ``_pricing``)."""
    ctx = CostContext.build(model, counts, trained, frozen, opts, student)
    out = {}
    for name, cost in _ordered():
        row = cost(ctx)
        if row is not None:
            out[name] = row
    return out


def dense_student(model):
    """The MoE -> dense student (the family's dense target, ``moe_lab.compress.dense``) on the meta device."""
    from ..compress.dense import dense_width, target_config

    with quiet_init():
        return meta_model(target_config(model.config, dense_width(moe_views(model))), next(model.parameters()).dtype)


def memory(counts: ParamCounts, trainable: int, act_bytes: dict, *, gpus: int, param_bytes: int,
           grad_bytes: int, optimizer_bytes: int, frozen_extra: int = 0, tokens: int = 0, elem: int = 2,
           inactive_pass: bool = False) -> list[dict]:
    """GPU (and CPU) memory per rank for each strategy, with and without activation checkpointing, in GiB
    (bytes / 2**30; the ``*_gb`` keys).

    Weights ``param_bytes * P`` (+ a frozen teacher for KD), gradients ``grad_bytes * T``, optimizer
    ``optimizer_bytes * T`` (fp32 master + Adam moments = 12). ZeRO-2 shards gradients and optimizer; ZeRO-3 and
    FSDP (full shard) shard everything and gather one layer at a time (twice the largest layer, prefetch);
    ZeRO-3 offload keeps parameters, gradients and optimizer states on the CPU. ``ep_ddp``: expert parallelism over
    the ``gpus`` ranks with DDP for the dense part (``hardware.ep_dense=ddp``): each rank holds 1/gpus of the routed
    experts (and of their gradients and optimizer state; trained experts first in ``trainable``), the rest whole;
    activations as DDP's (each rank runs its own tokens' share of expert work). ``ep`` (``hardware.ep_dense=zero1``,
    the default): the same with the dense part's AdamW moments (``MOMENT_BYTES`` per trained dense parameter)
    sharded over the ranks, ZeRO stage 1; its fp32 weights and gradients stay whole. Both EP rows add
    ``all_to_all_gb``: the bytes one rank sends per
    micro-batch of ``tokens`` tokens (dispatch and combine, forward and backward: 4 x tokens x top_k x hidden x
    ``elem`` per MoE layer, the share (gpus - 1) / gpus that leaves the rank; 0 for the other rows), and with
    ``inactive_pass`` (DenseMixer: every token through every expert outside its top-k, dispatched without autograd)
    2 x tokens x (E - k) x hidden x ``elem`` more per layer.
    """
    p = counts.total + frozen_extra
    layer = 2 * max(counts.per_layer_total.values()) * param_bytes
    w, g, o = p * param_bytes, trainable * grad_bytes, trainable * optimizer_bytes
    routed = sum(s.num_experts * s.matmul_params_per_expert for s in counts.experts)
    routed_trained = min(routed, trainable)
    kept = 1 - 1 / gpus  # the share of an EP rank's experts (and of its all-to-all rows) that lives elsewhere
    ep_ddp = (w - routed * param_bytes * kept, g - routed_trained * grad_bytes * kept,
              o - routed_trained * optimizer_bytes * kept)
    ep = (*ep_ddp[:2], ep_ddp[2] - (trainable - routed_trained) * min(MOMENT_BYTES, optimizer_bytes) * kept)
    exchanged = 4 * tokens * sum(s.top_k * s.hidden for s in counts.experts) * elem * kept
    if inactive_pass:
        exchanged += 2 * tokens * sum((s.num_experts - s.top_k) * s.hidden for s in counts.experts) * elem * kept
    rows = []
    for strategy in STRATEGIES:
        gpu = {"ddp": (w, g, o), "zero2": (w, g / gpus, o / gpus), "zero3": (w / gpus + layer, g / gpus, o / gpus),
               "fsdp": (w / gpus + layer, g / gpus, o / gpus), "zero3_offload": (layer, 0, 0), "ep": ep,
               "ep_ddp": ep_ddp}[strategy]
        cpu = w + g + o if strategy == "zero3_offload" else 0
        for ckpt in (False, True):
            act = act_bytes["checkpointed" if ckpt else "full"]
            rows.append({"strategy": strategy, "activation_checkpointing": ckpt, "gpus": gpus,
                         "params_gb": gpu[0] / 2**30, "grads_gb": gpu[1] / 2**30, "optimizer_gb": gpu[2] / 2**30,
                         "activations_gb": act / 2**30, "gpu_total_gb": (sum(gpu) + act) / 2**30,
                         "cpu_gb": cpu / 2**30,
                         "all_to_all_gb": exchanged / 2**30 if strategy.startswith("ep") else 0.0})
    return rows


def activation_bytes(measured, counts: ParamCounts, cost: dict, batch: int, seq_len: int, elem: int,
                     hidden: int) -> dict:
    """Activations per rank: measured non-expert saved tensors + ``2H + 3I`` elements per saved expert
    assignment (input, gate/up output, activation, output); with checkpointing, the layer inputs plus the
    largest single layer recomputed in the backward."""
    tokens = batch * seq_len
    scale = tokens / measured.tokens
    h = counts.experts[0].hidden if counts.experts else 0
    width = counts.experts[0].width if counts.experts else 0
    n_moe = max(len(counts.experts), 1)
    per_assign = (2 * h + 3 * width) * elem
    expert = tokens * (cost["expert_assignments_saved"] * per_assign + cost["extra_activation_elems_per_token"] * elem)
    layers = {k: v * scale for k, v in measured.saved_bytes.items() if k != "other"}
    full = sum(v * scale for v in measured.saved_bytes.values()) + expert
    biggest = max(layers.values(), default=0) + expert / n_moe
    ckpt = len(layers) * tokens * hidden * elem
    ckpt += measured.saved_bytes.get("other", 0) * scale + biggest
    return {"full": full, "checkpointed": ckpt}


def _required_fields(config_class: str) -> list[str]:
    """The fields an architecture entry must type in (a default would silently size the estimate), in the config
    class's own names: its ``attribute_map`` aliases (DBRX: ``d_model`` for ``hidden_size``) and the registry's
    top-k path (DBRX: ``ffn_config.moe_top_k``; Aria: ``moe_topk``)."""
    import transformers

    from ..moe.registry import FAMILIES

    cls = getattr(transformers, config_class, None)
    aliases = getattr(cls, "attribute_map", {}) or {}
    spec = FAMILIES.get(getattr(cls, "model_type", None))
    top_k = (spec.top_k_path if spec is not None else None) or "num_experts_per_tok"
    return [aliases.get(k, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")] \
        + [top_k]


def _given(arch: dict, path: str) -> bool:
    """Whether the dotted ``path`` is set in the architecture dict."""
    for name in path.split("."):
        if not isinstance(arch, dict) or name not in arch:
            return False
        arch = arch[name]
    return True


def architecture_config(model_cfg):
    """The HF config of a ``conf/model`` entry without weights: ``model.architecture`` (real models: the public
    config.json typed in), else ``config_class`` + ``config`` (tiny models), else the checkpoint's config.json."""
    from ..core.plain import to_plain
    from ..models import build_config

    cfg = dict(to_plain(model_cfg))
    arch = dict(cfg.get("architecture") or {})
    if arch:
        cls = arch.pop("config_class", None)
        if not cls:
            raise ValueError(f"model.architecture.config_class is missing for model={cfg.get('name')}: name the "
                             "transformers config class, e.g. Qwen3MoeConfig")
        for key in _required_fields(cls):
            if not _given(arch, key):
                raise ValueError(f"model.architecture.{key} is missing for model={cfg.get('name')} ({cls}): type it "
                                 "from the checkpoint's config.json")
        return build_config(cls, arch)
    if cfg.get("config_class"):
        return build_config(cfg["config_class"], cfg.get("config"))
    if cfg.get("pretrained"):
        import transformers

        try:
            return transformers.AutoConfig.from_pretrained(cfg["pretrained"])
        except OSError:
            raise ValueError(f"model={cfg.get('name')} has no model.architecture and {cfg['pretrained']!r} cannot be "
                             "read offline: add model.architecture (the config.json fields) or point "
                             "model.pretrained at a local folder") from None
    raise ValueError("model: set model.architecture, model.config_class or model.pretrained")


def estimate(config, *, seq_len: int, batch: int, opts: Options, gpus: int = 8, param_bytes: int = 2,
             grad_bytes: int = 2, optimizer_bytes: int = 12, dtype: torch.dtype = torch.bfloat16,
             with_student: bool = True) -> dict:
    """Everything ``task=estimate`` writes, for one HF config (no weights); ``with_student=False`` skips the MoE -> dense
    student (the ``kd`` / ``dense_student`` rows), the slowest part, when only fine-tuning methods are asked for.
    Every row of :data:`COST_ROWS` that applies is priced; a RuntimeError when only ``sft`` is registered
    (``moe_lab.methods``, whose modules register the others, not imported)."""
    if set(COST_ROWS) <= {"sft"}:
        raise RuntimeError("the estimate's cost table holds only the sft row: every other method's row is "
                           "registered by its module in moe_lab.methods; import moe_lab.methods before "
                           "calling moe_lab.analysis.estimate.estimate")
    with quiet_init():
        model = meta_model(config, dtype)
    counts = count_parameters(model)
    if not counts.experts:
        raise ValueError(f"{config.model_type}: the model has no MoE layer to estimate")
    student_model, student_note = None, "not asked for (with_student=False)"
    if with_student:
        try:
            student_model, student_note = dense_student(model), ""
        except (ValueError, AttributeError) as err:
            student_note = str(err)
    student = None
    if student_model is not None:
        s_counts = count_parameters(student_model)
        student = (s_counts, measure(student_model, batch, seq_len))
    trained = measure(model, batch, seq_len, train_non_experts=True)
    with quiet_init():
        frozen = measure(meta_model(config, dtype), batch, seq_len, train_non_experts=False)
    costs = method_costs(model, counts, trained, frozen, opts, student)
    elem = torch.finfo(dtype).bits // 8
    hidden = int(config.hidden_size)
    no_in = counts.total - counts.input_embedding
    k = {s.layer: s.top_k for s in counts.experts}
    out_methods = {}
    for name, c in costs.items():
        pricing = c.pop(PRICING)
        if pricing.on_student and student is None:
            raise ValueError(f"estimate: the {name} row is priced on the dense student, which is unavailable "
                             f"({student_note}); its row function must return None without a student")
        s_counts = student[0] if pricing.on_student else counts
        measured = student[1] if pricing.on_student else trained
        total = s_counts.total
        active = s_counts.active() if pricing.on_student else counts.active(
            k if pricing.active_top_k is None else pricing.active_top_k)
        act = activation_bytes(measured, s_counts, c, batch, seq_len, elem, hidden)
        out_methods[name] = {
            **c, "params_total": total, "params_active": active,
            "params_active_no_input_embedding": active - s_counts.input_embedding,
            "flops_per_step_forward": c["flops_per_token_forward"] * batch * seq_len,
            "flops_per_step_backward": c["flops_per_token_backward"] * batch * seq_len,
            "ratio_to_sft": (c["flops_per_token_forward"] + c["flops_per_token_backward"]) /
            (costs["sft"]["flops_per_token_forward"] + costs["sft"]["flops_per_token_backward"]),
            "memory": memory(s_counts, c["params_trainable"], act, gpus=gpus, param_bytes=param_bytes,
                             grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
                             frozen_extra=pricing.teacher_params, tokens=batch * seq_len, elem=elem,
                             inactive_pass=pricing.inactive_pass),
        }
    t = trained.tokens
    active_layer = counts.per_layer_active()
    shapes = {s.layer: s for s in counts.experts}
    per_layer = []
    for key, f in trained.forward.items():
        if key == "other":
            continue
        i = int(key.split(".")[1])
        s = shapes.get(i)
        e = 2 * s.matmul_params_per_expert if s else 0
        per_layer.append({
            "layer": i, "moe": s is not None, "params_total": counts.per_layer_total[i],
            "params_active": active_layer[i],
            "flops_per_token_forward_sft": f / t + (e * s.top_k if s else 0),
            "flops_per_token_all_experts_forward": f / t + (e * s.num_experts if s else 0),
            "flops_per_token_backward_sft": trained.backward[key] / t + (2 * e * s.top_k if s else 0)})
    return {
        "model_type": config.model_type, "seq_len": seq_len, "batch": batch, "tokens_per_step": batch * seq_len,
        "params_total": counts.total, "params_active": counts.active(),
        "params_total_no_input_embedding": no_in,
        "params_active_no_input_embedding": counts.active() - counts.input_embedding,
        "params_total_no_embeddings": no_in - counts.output_embedding,
        "params_active_no_embeddings": counts.active() - counts.input_embedding - counts.output_embedding,
        "params_routed_experts": counts.routed, "params_router": counts.router, "params_shared_experts": counts.shared,
        "moe_layers": len(counts.experts), "num_layers": len(counts.per_layer_total),
        "methods": out_methods, "per_layer": per_layer,
        "dense_student": ({"params_total": student[0].total,
                           "params_no_input_embedding": student[0].total - student[0].input_embedding}
                          if student else {"unavailable": student_note}),
        "options": vars(opts),
        "condense": _condense_table(model, counts),
    }


def _condense_table(model, counts: ParamCounts) -> dict[str, list[dict]]:
    """CD-MoE / trimming of the first n MoE layers, n = 1..all: total, active, memory ratio per variant."""
    parts = list(moe_layer_parts(model).values())
    return {v: [{"layers": n, **condensed_parameters(counts.total, counts.active(), parts[:n], v)}
                for n in range(1, len(parts) + 1)] for v in CONDENSE_VARIANTS}


CONDENSE_VARIANTS = ("cd_moe_s", "cd_moe_sr", "layer_trim", "block_trim")


@dataclass
class MoELayerParts:
    """Parameters of one MoE decoder layer by role (CD-MoE / layer-pruning memory arithmetic)."""

    per_expert: int
    num_experts: int
    top_k: int
    router: int
    shared: int  # shared expert(s) and their gate
    moe_block: int  # the whole MoE sub-block (routed + router + shared)
    decoder_layer: int  # attention, norms and the MoE sub-block


def moe_layer_parts(model) -> dict[int, MoELayerParts]:
    """``{layer: MoELayerParts}`` of a (meta) model, from the uniform MoE view."""
    counts = count_parameters(model)
    shapes = {s.layer: s for s in counts.experts}
    out = {}
    for view in moe_views(model):
        s = shapes[view.index]
        shared = sum(p.numel() for m in (view.shared, view.shared_gate) if m is not None for p in m.parameters())
        out[view.index] = MoELayerParts(s.params_per_expert, s.num_experts, s.top_k, s.router_params, shared,
                                        sum(p.numel() for p in view.block.parameters()),
                                        counts.per_layer_total[view.index])
    return out


def condensed_parameters(total: int, active: int, parts: list[MoELayerParts], variant: str,
                         kept_routed: int | None = None) -> dict:
    """Total / active parameters and memory ratio after condensing (CD-MoE) or trimming the given MoE layers.

    cd_moe_s: routed experts and router removed (shared kept, every token); cd_moe_sr: ``kept_routed`` routed
    experts (default top-k) kept with fixed gates, the rest and the router removed; layer_trim: the whole MoE
    sub-block removed; block_trim: the whole decoder layer removed (spec 3.3, 3.7).
    """
    if variant not in CONDENSE_VARIANTS:
        raise ValueError(f"variant={variant!r}: choose one of {', '.join(CONDENSE_VARIANTS)}")
    removed = removed_active = 0
    for p in parts:
        keep = 0 if variant == "cd_moe_s" else (p.top_k if kept_routed is None else int(kept_routed))
        if variant in ("cd_moe_s", "cd_moe_sr"):
            removed += (p.num_experts - keep) * p.per_expert + p.router
            removed_active += (p.top_k - keep) * p.per_expert + p.router
        elif variant == "layer_trim":
            removed += p.moe_block
            removed_active += p.moe_block - (p.num_experts - p.top_k) * p.per_expert
        else:
            removed += p.decoder_layer
            removed_active += p.decoder_layer - (p.num_experts - p.top_k) * p.per_expert
    return {"params_total": total - removed, "params_active": active - removed_active,
            "memory_ratio": (total - removed) / total}
