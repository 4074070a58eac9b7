"""Cost estimates without weights: FLOPs per token (forward, backward) for every fine-tuning method, total and
active parameters, and training memory per hardware strategy.

Non-expert costs (attention as causal fused attention, projections, router, shared experts, dense layers,
lm_head) are measured on the meta device (:mod:`.meta_costs`); routed experts are counted analytically from
their packed tensors: one expert on one token costs ``2 * m`` FLOPs forward (``m`` = its matmul weights), as
much again for the input gradient and again for the weight gradient.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .meta_costs import ParamCounts, count_parameters, measure, meta_model, moe_views, quiet_init

log = logging.getLogger(__name__)

METHODS = ("sft", "densemixer", "condenser_replace", "condenser_append", "compressed_experts", "esft", "lora",
           "kd", "dense_student")
STRATEGIES = ("ddp", "zero2", "zero3", "zero3_offload", "fsdp", "ep", "ep_ddp")
MOMENT_BYTES = 8  # AdamW's two fp32 moments per trained parameter: what ZeRO-1 shards beside EP (``ep`` row)


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


def _expert_sum(counts: ParamCounts, per_layer) -> int:
    """Sum over MoE layers of ``per_layer(shape) * 2 * matmul params per expert`` (FLOPs per token)."""
    return int(sum(per_layer(s) * 2 * s.matmul_params_per_expert for s in counts.experts))


def _lora_linears(model) -> list[tuple[str, int, int]]:
    """(name, in, out) of every nn.Linear LoRA targets: all but routers and the lm_head (public DenseMixer setup)."""
    routers = {id(v.router) for v in moe_views(model)}
    out_emb = model.get_output_embeddings()
    return [(n, m.in_features, m.out_features) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m) not in routers and m is not out_emb]


def _compressed_experts_costs(counts: ParamCounts, opts: Options, row, experts, f_rest: int, b_rest: int) -> dict:
    """Compressed Experts' row: ``k_main`` experts run (default k // 2), the others as scaling vectors."""
    km = {s.layer: opts.k_main or s.top_k // 2 for s in counts.experts}
    for s in counts.experts:
        if not 1 <= km[s.layer] < s.top_k:
            raise ValueError(f"task.methods.k_main={opts.k_main} must be in 1..top_k-1 (top_k={s.top_k})")
    if opts.compressed_form not in ("input", "gate_up_intermediate"):
        raise ValueError(f"task.methods.compressed_form={opts.compressed_form!r}: choose input or gate_up_intermediate")
    vec = sum(s.num_experts * (s.hidden if opts.compressed_form == "input" else 2 * s.hidden + s.width)
              for s in counts.experts)
    return row(
        f_rest + experts(lambda s: km[s.layer]), b_rest + 2 * experts(lambda s: km[s.layer]), counts.total + vec,
        sum(km.values()), note=f"k_main experts run ({opts.compressed_form} vectors: {vec:,} parameters)")


def method_costs(model, counts: ParamCounts, trained, frozen, opts: Options, student=None) -> dict[str, dict]:
    """Per-token FLOPs (forward / backward), trainable parameters and expert activations per method."""
    t = trained.tokens
    f_rest, b_rest, b_frozen = trained.total("forward") / t, trained.total("backward") / t, frozen.total("backward") / t
    h = int(model.config.hidden_size)
    k = {s.layer: s.top_k for s in counts.experts}

    def experts(n):  # FLOPs of n(shape) experts per token in every MoE layer
        return _expert_sum(counts, n)

    def row(fwd, bwd, trainable, assignments, extra_act=0.0, note=""):
        return {"flops_per_token_forward": fwd, "flops_per_token_backward": bwd, "params_trainable": int(trainable),
                "expert_assignments_saved": assignments, "extra_activation_elems_per_token": extra_act,
                "note": note}

    sft_f, sft_b = f_rest + experts(lambda s: s.top_k), b_rest + 2 * experts(lambda s: s.top_k)
    assign_k = sum(k.values())
    out = {"sft": row(sft_f, sft_b, counts.total, assign_k, note="HF routing; gradients through the top-k")}
    ste = sum(2 * s.num_experts * h for s in counts.experts)  # <dL/dy, E_e(x)> for every expert
    inactive = experts(lambda s: s.num_experts - s.top_k)
    out["densemixer"] = row(
        sft_f, sft_b + inactive + ste, counts.total, assign_k,
        note="forward = SFT; backward = SFT + the inactive experts run without autograd (chunked, nothing "
        "stored) + the router's straight-through products (the paper counts the inactive experts in its forward)")
    out["densemixer"]["flops_per_token_inactive_experts"] = inactive
    out["condenser_replace"] = row(sft_f, sft_b, counts.total, assign_k, note="|S| = k: top-(k-n) + n condensers")
    n = opts.condenser_n
    out["condenser_append"] = row(f_rest + experts(lambda s: s.top_k + n), b_rest + 2 * experts(lambda s: s.top_k + n),
                                  counts.total, assign_k + n * len(k), note=f"|S| = k + {n}")
    if opts.k_main is not None or all(s.top_k >= 2 for s in counts.experts):
        out["compressed_experts"] = _compressed_experts_costs(counts, opts, row, experts, f_rest, b_rest)
    else:  # a top-1 router runs no auxiliary expert: Compressed Experts is undefined there (the method refuses)
        log.info("estimate: no compressed_experts row (a top-1 router has no auxiliary expert to compress)")
    share = opts.esft_assignment_share
    out["esft"] = row(
        sft_f, b_frozen + experts(lambda s: s.top_k) + share * experts(lambda s: s.top_k),
        opts.esft_expert_share * counts.routed, assign_k,
        note=f"frozen weights skip their weight gradients; {share:.0%} of assignments hit trained experts")
    r = opts.lora_rank
    lin = _lora_linears(model)
    lora_dense = sum(2 * r * (i + o) for _, i, o in lin)
    lora_exp = sum(s.top_k * 2 * r * (3 * s.hidden + 3 * s.width) for s in counts.experts)
    lora_params = sum(r * (i + o) for _, i, o in lin) + sum(
        s.num_experts * r * (3 * s.hidden + 3 * s.width) for s in counts.experts) + counts.router
    out["lora"] = row(
        sft_f + lora_dense + lora_exp,
        b_frozen + experts(lambda s: s.top_k) + 2 * (lora_dense + lora_exp) + sum(2 * s.router_params for s in counts.experts),
        lora_params, assign_k, note=f"rank {r} on every linear and expert projection, router full rank (trained)")
    if student is not None:
        s_counts, s_trained = student
        st = s_trained.tokens
        s_f = s_trained.total("forward") / st + _expert_sum(s_counts, lambda s: s.top_k)
        s_b = s_trained.total("backward") / st + 2 * _expert_sum(s_counts, lambda s: s.top_k)
        kp = opts.kd_teacher_top_k
        teacher_f = f_rest + experts(lambda s: kp or s.top_k)
        out["kd"] = row(s_f + teacher_f, s_b, s_counts.total, sum(s.top_k for s in s_counts.experts),
                        note=f"teacher forward at k'={kp or 'k'} (no grad) + dense student forward/backward")
        out["dense_student"] = row(s_f, s_b, s_counts.total, sum(s.top_k for s in s_counts.experts),
                                   note="the MoE -> dense student trained alone")
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
    student (the ``kd`` / ``dense_student`` rows), the slowest part, when only fine-tuning methods are asked for."""
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
        is_student = name in ("kd", "dense_student")
        s_counts = student[0] if is_student else counts
        measured = student[1] if is_student else trained
        total = s_counts.total
        active = s_counts.active() if is_student else counts.active(
            {i: v + (opts.condenser_n if name == "condenser_append" else 0) -
             (v - (opts.k_main or v // 2) if name == "compressed_experts" else 0) for i, v in k.items()})
        act = activation_bytes(measured, s_counts, c, batch, seq_len, elem, hidden)
        teacher = counts.total if name == "kd" else 0
        out_methods[name] = {
            **c, "params_total": total, "params_active": active,
            "params_active_no_input_embedding": active - s_counts.input_embedding,
            "flops_per_step_forward": c["flops_per_token_forward"] * batch * seq_len,
            "flops_per_step_backward": c["flops_per_token_backward"] * batch * seq_len,
            "ratio_to_sft": (c["flops_per_token_forward"] + c["flops_per_token_backward"]) /
            (costs["sft"]["flops_per_token_forward"] + costs["sft"]["flops_per_token_backward"]),
            "memory": memory(s_counts, c["params_trainable"], act, gpus=gpus, param_bytes=param_bytes,
                             grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, frozen_extra=teacher,
                             tokens=batch * seq_len, elem=elem, inactive_pass=name == "densemixer"),
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
