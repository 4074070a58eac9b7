"""The family registry: the ONLY place in moe-lab that knows how HF MoE families differ.

One :class:`FamilySpec` per ``config.model_type``. Everything else reads the uniform view built from
it (:mod:`moe_lab.moe.view`). Adding a family = one entry here + one tiny config + the conformance suite.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from .routing import RoutingRule


@dataclass(frozen=True)
class DenseTarget:
    """The vanilla HF architecture a family's MoE -> dense conversion writes (``moe_lab.compress.dense``).

    form: ``"mlp"`` = a dense class whose every decoder layer has one gated MLP (gate_proj/up_proj/down_proj)
    of the common width, shared experts concatenated into it and teacher dense layers zero-padded; or
    ``"one_expert"`` = the family's own class with ONE routed expert of width k*I that every token selects
    with weight 1.0 (softmax / top-k over one logit), router zeroed, shared experts (and their gates) kept; or
    ``"k_experts"`` = the family's own class with k routed experts of the teacher's width (the k representatives)
    and top_k = k, so that a zeroed router selects all of them with one constant weight (where the experts' width
    field also sizes the shared experts, or the block itself does more than sum its experts). A routed target's
    down projections are divided by the weight its block gives an expert (``compress.dense.routed_weight``); a
    k_experts student's zeroed router still receives gradients in distillation (freeze it to keep the weights fixed).
    config_class: transformers config class of the target (None = the teacher's). overrides(config, width):
    the target config fields that differ from the teacher's.
    """

    form: str
    overrides: Callable[[object, int], dict]
    config_class: str | None = None
    note: str = ""


def _dense_mlp(config, width) -> dict:
    return {"intermediate_size": width}


def _dense_deepseek(config, width) -> dict:
    return {"intermediate_size": width, "first_k_dense_replace": config.num_hidden_layers}


def _one_expert_overrides(width_field: str, count_field: str, config, width) -> dict:
    groups = {"n_group": 1, "topk_group": 1} if getattr(config, "n_group", None) else {}
    return {width_field: width, count_field: 1, "num_experts_per_tok": 1, **groups}


def _k_experts_overrides(count_field: str, top_k_field: str, config, width) -> dict:
    groups = {"n_group": 1, "topk_group": 1} if getattr(config, "n_group", None) else {}
    return {count_field: getattr(config, top_k_field), **groups}


def _k_experts(count_field: str, top_k_field: str = "num_experts_per_tok"):
    """Config overrides for a k-expert, top-k = k model of the same family (picklable)."""
    return functools.partial(_k_experts_overrides, count_field, top_k_field)


# the config switches that make a decoder layer dense, and their all-dense values (L = num_hidden_layers)
_DENSE_SWITCHES: dict[str, Callable[[int], object]] = {
    "mlp_layer_types": lambda n: ["dense"] * n, "first_k_dense_replace": lambda n: n,
    "mlp_only_layers": lambda n: list(range(n)), "num_dense_layers": lambda n: n, "moe_layer_start_index": lambda n: n,
}


def _all_dense_overrides(width_field: str, config, width) -> dict:
    n = config.num_hidden_layers
    switches = {k: v(n) for k, v in _DENSE_SWITCHES.items() if getattr(config, k, None) is not None}
    return {width_field: width, **switches}


def _all_dense(width_field: str = "intermediate_size"):
    """Config overrides for the family's own class with every decoder layer dense (each switch of
    ``_DENSE_SWITCHES`` the config has), dense MLP width ``width`` in ``width_field`` (picklable)."""
    return functools.partial(_all_dense_overrides, width_field)


# the family's own class with every layer dense (its dense MLP: a plain SwiGLU, same activation as its experts)
_ALL_DENSE = DenseTarget("mlp", _all_dense())


def _one_expert(width_field: str, count_field: str):
    """Config overrides for a one-expert (dense) model of the same family (picklable)."""
    return functools.partial(_one_expert_overrides, width_field, count_field)


@dataclass(frozen=True)
class FamilySpec:
    """What distinguishes one HF MoE family (transformers v5)."""

    model_type: str
    block_class: str  # HF sparse-MoE block class; also the DeepSpeed ZeRO-3 leaf module
    router_attr: str  # attribute of the block holding the router ("gate" | "router")
    routing_rule: Callable[[object], RoutingRule]  # built from the HF config
    # how the routed experts' tensors are stored (moe_lab.moe.layout.LAYOUTS): "gate_up": packed [E, 2I, H] chunked,
    # F.linear; "gpt_oss": packed [E, H, 2I] interleaved + biases; "transposed": packed gate_up [E, H, 2I] (gate
    # columns, then up columns) and down [E, I, H], applied as x @ W, no biases (Llama 4, Aria); "w1_v1_w2": three
    # [E*I, H] tensors in experts.mlp (DBRX)
    expert_layout: str = "gate_up"
    shared_attr: str | None = None  # shared expert module(s)
    shared_gate_attr: str | None = None  # sigmoid gate on the shared expert (Qwen2-MoE)
    shared_first: bool = False  # HF runs the shared expert before the router (its gate after the experts)
    shared_after_router: bool = False  # HF runs the shared expert between the router and the routed experts (AFMoE)
    # HF calls the routed experts on their own view of the block input and the shared experts on the block input
    # itself (DeepSeek-V2/V3's ``residuals``), so autograd sums the input gradient per consumer first: moe-lab does
    # the same (under the eager experts backend, whose per-expert index ops each add a piece, the sums otherwise
    # round differently)
    experts_own_view: bool = False
    returns_router_scores: bool = False  # block returns (hidden, router_scores) (GPT-OSS)
    returns_router_logits: bool = False  # block returns (hidden, router_logits) (Llama 4)
    router_logits_index: int = 0  # where the HF router's output tuple holds the logits (HF records them there)
    # the routing weight scales each routed expert's INPUT, y = sum_e E_e(w_e x), not its output (Llama 4); HF's
    # experts module then takes the E weight-scaled copies of the tokens [E*N, H] and runs every expert on its copy
    # (a zero weight gives an exactly zero output: SwiGLU without biases)
    weight_on_input: bool = False
    aux_loss_field: str | None = "router_aux_loss_coef"  # config field (dotted path) of the load-balancing coef.
    aux_loss_model_attr: str | None = None  # the model attribute HF copies it into at init, where its name differs
    # load-balancing loss (moe_lab.moe.aux_loss): "hf" (HF adds its Switch loss) | "sequence" (DeepSeek
    # sequence-wise loss, added by moe-lab) | "switch" (Switch loss added by moe-lab)
    aux_loss: str = "hf"
    native_aux_loss_coef: float = 0.0  # native coefficient when the config has no aux_loss_field
    # config field (a dotted path into a sub-config: "ffn_config.moe_jitter_eps") of multiplicative input jitter
    jitter_field: str | None = None
    jitter_passes: int = 1  # how many times the HF block applies that jitter
    jitter_when_set: bool = False  # HF draws the jitter whenever the field is not None, 0 included (DBRX), not only > 0
    notes: str = ""
    real_checkpoints: tuple[str, ...] = field(default_factory=tuple)
    dense_target: DenseTarget | None = None  # MoE -> dense conversion target; None: no vanilla mapping
    vanilla_top_k: int | None = None  # HF's block always routes this many experts, whatever num_experts_per_tok
    # selection-only bias, path relative to the block, where it is not the router's e_score_correction_bias: a block
    # buffer passed to the router (MiniMax-M2, LFM2-MoE, HY-V3, AFMoE) or ERNIE's [1, E] gate.moe_statics parameter
    correction_bias_attr: str | None = None
    expert_act: str = "act_fn"  # "act_fn": act(gate) * up; "apply_gate": the experts' own _apply_gate (clamped GLU)
    shared_combine_field: str | None = None  # config field: "sum" (default) or "average" of routed + shared (Cohere2)
    output_norm_attr: str | None = None  # a norm the block applies to its own output (AXK1's post_mlp_layernorm)
    output_scaling_field: str | None = None  # config field scaling the routed mixture output, not the weights (Beam)
    router_weight_attr: str = "weight"  # the router's [E, H] weight, relative to the router ("wg.weight": Hunyuan)
    fp32_combine_field: str | None = None  # config flag: routed + shared summed in fp32, then cast back (HY-V3)
    # config fields (dotted paths) of the routed-expert count and top-k, where not top-level (DBRX's ffn_config);
    # None: the count field found by expert_count_field, and num_experts_per_tok
    expert_count_path: str | None = None
    top_k_path: str | None = None


def _softmax_rule(config, renormalize=None, cast=True) -> RoutingRule:
    return RoutingRule(
        score="softmax",
        top_k=config.num_experts_per_tok,
        num_experts=_num_experts(config),
        renormalize=bool(config.norm_topk_prob) if renormalize is None else renormalize,
        weights_in_logits_dtype=cast,
    )


def _num_experts(config) -> int:
    return int(getattr(config, expert_count_field(config)))


def expert_count_field(config) -> str:
    """The HF config field holding the number of routed experts (num_experts | num_local_experts | ...)."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, name, None):
            return name
    raise ValueError(f"{type(config).__name__} has no expert count field")


def config_value(config, path: str, default=None):
    """The value of config field ``path``, a dotted path into sub-configs ("ffn_config.moe_jitter_eps")."""
    for name in path.split("."):
        config = getattr(config, name, None)
        if config is None:
            return default
    return config


def set_config_value(config, path: str, value) -> None:
    """Set config field ``path`` (a dotted path into sub-configs) to ``value``."""
    owner, _, name = path.rpartition(".")
    setattr(config_value(config, owner) if owner else config, name, value)


def update_config_dict(values: dict, fields: dict) -> dict:
    """``values`` (a ``config.to_dict()``) with ``fields`` set, dotted paths into its sub-config dicts; returned."""
    for path, value in fields.items():
        *owners, name = path.split(".")
        functools.reduce(dict.__getitem__, owners, values)[name] = value
    return values


def _nested_overrides(width_path: str, count_path: str, top_k_path: str, config, width) -> dict:
    return {width_path: width, count_path: 1, top_k_path: 1}


def routing_size_paths(spec: FamilySpec, config) -> tuple[str, str]:
    """``(expert count, top-k)`` config field paths of ``spec``'s family (dotted into sub-configs for DBRX)."""
    return spec.expert_count_path or expert_count_field(config), spec.top_k_path or "num_experts_per_tok"


def _dbrx_rule(config) -> RoutingRule:
    ffn = config.ffn_config
    p = ffn.moe_normalize_expert_weights
    return RoutingRule(score="softmax", top_k=ffn.moe_top_k, num_experts=ffn.moe_num_experts,
                       softmax_in_logits_dtype=True, renormalize=p is not None,
                       renorm_p=None if p is None else float(p))


def _deepseek_v2_rule(config) -> RoutingRule:
    grouped = config.topk_method == "group_limited_greedy"
    return RoutingRule(
        score="softmax",
        top_k=config.num_experts_per_tok,
        num_experts=_num_experts(config),
        logits_fp32=True,
        scaling=float(config.routed_scaling_factor),
        n_group=config.n_group if grouped else None,
        topk_group=config.topk_group if grouped else None,
        group_score="max",
        group_fill=0.0,
        group_masks_weights=True,
        weights_in_logits_dtype=False,
        sorted_topk=False,
    )


def _deepseek_v3_rule(config) -> RoutingRule:
    return RoutingRule(
        score="sigmoid",
        top_k=config.num_experts_per_tok,
        num_experts=_num_experts(config),
        logits_fp32=True,
        renormalize=bool(config.norm_topk_prob),
        renorm_eps=1e-20,
        scaling=float(config.routed_scaling_factor),
        n_group=config.n_group,
        topk_group=config.topk_group,
        group_score="top2_sum",
        uses_correction_bias=True,
        weights_in_logits_dtype=False,
        sorted_topk=False,
    )


def _gpt_oss_rule(config) -> RoutingRule:
    return RoutingRule(
        score="identity",
        top_k=config.num_experts_per_tok,
        num_experts=_num_experts(config),
        softmax_over_topk=True,
    )


def _aria_rule(config) -> RoutingRule:
    """Aria's AriaTextTopKRouter: top-k of the raw logits (moe_topk of moe_num_experts), softmax over them in the
    logits dtype (GPT-OSS's rule without its router bias)."""
    return RoutingRule(score="identity", top_k=config.moe_topk, num_experts=config.moe_num_experts,
                       softmax_over_topk=True)


def _granite_rule(config) -> RoutingRule:
    """GPT-OSS's top-k-then-softmax, with Granite's dtypes (fp32 logits, weights back in the input dtype)."""
    return dataclasses.replace(_gpt_oss_rule(config), logits_upcast=True, weights_in_logits_dtype=False,
                               weights_in_input_dtype=True)


def _fp32_rule(score: str, config) -> RoutingRule:
    """fp32 router matmul, ``score`` (softmax | sigmoid) top-k, optionally renormalised, weights left fp32 or cast
    to the input dtype by the block (FlintTopKRouter / LaraMiniTopKRouter)."""
    return RoutingRule(
        score=score,
        top_k=config.num_experts_per_tok,
        num_experts=_num_experts(config),
        logits_fp32=True,
        renormalize=bool(config.norm_topk_prob),
        weights_in_input_dtype=score == "softmax",
    )


def _block_bias_rule(config, **fields) -> RoutingRule:
    """Sigmoid top-k with a selection-only bias held by the block (registry ``correction_bias_attr``)."""
    return RoutingRule(score="sigmoid", top_k=config.num_experts_per_tok, num_experts=_num_experts(config), **fields)


def _minimax_m2_rule(config) -> RoutingRule:
    return _block_bias_rule(config, scores_fp32=True, uses_correction_bias=True, renormalize=True, sorted_topk=False,
                            weights_in_logits_dtype=False)


def _lfm2_moe_rule(config) -> RoutingRule:
    return _block_bias_rule(config, uses_correction_bias=bool(config.use_expert_bias),
                            renormalize=bool(config.norm_topk_prob), renorm_eps=1e-6,
                            scaling=float(config.routed_scaling_factor))


def _hy_v3_rule(config) -> RoutingRule:
    return _block_bias_rule(config, logits_fp32=True, uses_correction_bias=True, renormalize=True, renorm_eps=1e-20,
                            scaling=float(config.router_scaling_factor), sorted_topk=False,
                            weights_in_logits_dtype=False)


def _inkling2_rule(config) -> RoutingRule:
    if config.scoring_func != "sigmoid":  # the router's ACT2FN[scoring_func]
        raise ValueError(f"scoring_func={config.scoring_func!r} is not supported: the routing rule of "
                         f"{config.model_type} is the checkpoints' scoring_func='sigmoid'")
    return _block_bias_rule(config, logits_fp32=True, uses_correction_bias=True, renormalize=True, renorm_eps=1e-20,
                            scaling=float(config.route_scale), sorted_topk=False, weights_in_logits_dtype=False)


def _afmoe_rule(config) -> RoutingRule:
    return _block_bias_rule(config, logits_upcast=True, uses_correction_bias=True, renormalize=True, renorm_eps=1e-20,
                            scaling=float(config.route_scale), weights_in_logits_dtype=False)


def _hunyuan_rule(config) -> RoutingRule:
    per_layer = [name for name in ("num_experts", "moe_topk") if isinstance(getattr(config, name), list)]
    if per_layer:
        raise ValueError(f"per-layer {' / '.join(per_layer)} lists are not supported: give one int each")
    return RoutingRule(score="softmax", top_k=config.moe_topk, num_experts=config.num_experts, renormalize=True,
                       logits_in_weight_dtype=True)


def _ernie_rule(config) -> RoutingRule:
    return RoutingRule(score="softmax", top_k=config.num_experts_per_tok, num_experts=_num_experts(config),
                       logits_fp32=True, uses_correction_bias=True, renormalize=True,
                       renorm_min=float(config.moe_norm_min), weights_in_logits_dtype=False,
                       weights_in_input_dtype=True)


def _minimax_m3_rule(config) -> RoutingRule:
    return _block_bias_rule(config, logits_in_weight_dtype=True, scores_fp32=True, uses_correction_bias=True,
                            renormalize=True, sorted_topk=False, weights_in_logits_dtype=False)


def _beam_rule(config) -> RoutingRule:
    return _block_bias_rule(config, logits_fp32=True, uses_correction_bias=True, renormalize=bool(config.norm_topk_prob),
                            renorm_eps=1e-20, n_group=config.n_group, topk_group=config.topk_group,
                            group_score="top2_sum", weights_in_logits_dtype=False)


def _laguna_rule(config) -> RoutingRule:
    cap = float(config.moe_router_logit_softcapping or 0.0)
    return _block_bias_rule(config, logits_upcast=True, logit_softcap=cap if cap > 0 else None,
                            uses_correction_bias=True, renormalize=True, weights_in_logits_dtype=False,
                            weights_in_input_dtype=True)


def _kolibri_rule(config) -> RoutingRule:
    return _block_bias_rule(config, logits_fp32=True, select_on_logits=True, uses_correction_bias=True,
                            renormalize=bool(config.norm_topk_prob))


def _axk2_rule(config) -> RoutingRule:
    return dataclasses.replace(_deepseek_v3_rule(config), biased_group_fill=0.0)


def _cohere2_moe_rule(config) -> RoutingRule:
    if config.expert_selection_fn == "sigmoid":  # sigmoid of the top-k logits, optionally renormalised
        return RoutingRule(score="sigmoid", top_k=config.num_experts_per_tok, num_experts=_num_experts(config),
                           select_on_logits=True, renormalize=bool(config.norm_topk_prob),
                           weights_in_input_dtype=True)
    return RoutingRule(score="identity", top_k=config.num_experts_per_tok, num_experts=_num_experts(config),
                       softmax_over_topk=True, topk_softmax_fp32=True, weights_in_logits_dtype=False,
                       weights_in_input_dtype=True)


def _phimoe_rule(config) -> RoutingRule:
    return RoutingRule(
        score="sparsemixer",
        top_k=config.num_experts_per_tok,
        num_experts=_num_experts(config),
        jitter_eps=float(config.router_jitter_noise),
        weights_in_logits_dtype=False,
    )


def _llama4_rule(config) -> RoutingRule:
    """Top-k of the logits; weights = fp32 sigmoid of the [N, E] logits with -inf off the top-k, cast back."""
    return RoutingRule(score="sigmoid", top_k=config.num_experts_per_tok, num_experts=_num_experts(config),
                       select_on_logits=True, scatter_scores=True, scores_fp32=True)


_CORE: dict[str, FamilySpec] = {
    spec.model_type: spec
    for spec in (
        FamilySpec(
            "olmoe", "OlmoeSparseMoeBlock", "gate", _softmax_rule,
            real_checkpoints=("allenai/OLMoE-1B-7B-0924",),
            dense_target=DenseTarget("one_expert", _one_expert("intermediate_size", "num_experts"),
                                     note="no dense class has OLMoE's full-width q/k-norm: one-expert OLMoE"),
        ),
        FamilySpec(
            "qwen2_moe", "Qwen2MoeSparseMoeBlock", "gate", _softmax_rule,
            shared_attr="shared_expert", shared_gate_attr="shared_expert_gate", shared_first=True,
            notes="sigmoid-gated shared expert; dense layers from mlp_only_layers/decoder_sparse_step",
            real_checkpoints=("Qwen/Qwen1.5-MoE-A2.7B",),
            dense_target=DenseTarget("one_expert", _one_expert("moe_intermediate_size", "num_experts"),
                                     note="keeps the sigmoid-gated shared expert exactly: one-expert Qwen2-MoE"),
        ),
        FamilySpec(
            "qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate", _softmax_rule,
            notes="renormalised top-k; dense layers from mlp_only_layers",
            real_checkpoints=("Qwen/Qwen3-30B-A3B",),
            dense_target=DenseTarget("mlp", _dense_mlp, "Qwen3Config"),
        ),
        FamilySpec(
            "deepseek_v2", "DeepseekV2Moe", "gate", _deepseek_v2_rule,
            shared_attr="shared_experts", experts_own_view=True, aux_loss="sequence", aux_loss_field="aux_loss_alpha",
            native_aux_loss_coef=0.001,
            notes="greedy or group-limited greedy top-k, routed scaling, first_k_dense_replace dense layers; "
            "HF computes no aux loss: moe-lab adds DeepSeek-V2's sequence-wise expert balance loss (seq_aux) at "
            "the checkpoint's aux_loss_alpha (DeepSeek-V2-Lite config.json and paper: 0.001; HF's config class "
            "has no such field, hence the fallback)",
            real_checkpoints=("deepseek-ai/DeepSeek-V2-Lite",),
            dense_target=DenseTarget("mlp", _dense_deepseek),
        ),
        FamilySpec(
            "deepseek_v3", "DeepseekV3MoE", "gate", _deepseek_v3_rule,
            shared_attr="shared_experts", experts_own_view=True, aux_loss="sequence", aux_loss_field=None,
            notes="sigmoid scores, e_score_correction_bias for selection, group-limited (top-2 sum) top-k; "
            "HF computes no aux loss and the checkpoint's remote code trains none (noaux_tc: balance by the "
            "correction bias): native coefficient 0; an explicit aux_loss_coef adds the V3 paper's "
            "complementary sequence-wise loss (normalised sigmoid affinities; the paper uses 1e-4)",
            real_checkpoints=("deepseek-ai/DeepSeek-V3",),
            dense_target=DenseTarget("mlp", _dense_deepseek),
        ),
        FamilySpec(
            "gpt_oss", "GptOssMLP", "router", _gpt_oss_rule, expert_layout="gpt_oss",
            expert_act="apply_gate", returns_router_scores=True,
            notes="top-k on biased logits, softmax over the top-k, clamped SwiGLU with expert biases",
            real_checkpoints=("openai/gpt-oss-20b",),
            dense_target=DenseTarget("one_expert", _one_expert("intermediate_size", "num_local_experts"),
                                     note="GPT-OSS activation and biases: one-expert GPT-OSS"),
        ),
        FamilySpec(
            "mixtral", "MixtralSparseMoeBlock", "gate",
            functools.partial(_softmax_rule, renormalize=True, cast=False),
            jitter_field="router_jitter_noise",
            real_checkpoints=("mistralai/Mixtral-8x7B-v0.1",),
            dense_target=DenseTarget("mlp", _dense_mlp, "MistralConfig"),
        ),
        FamilySpec(
            "phimoe", "PhimoeSparseMoeBlock", "router", _phimoe_rule,
            jitter_field="input_jitter_noise", jitter_passes=2, vanilla_top_k=2,
            notes="sparsemixer top-2 (Gumbel sampling in training, Heun's third-order gradient)",
            real_checkpoints=("microsoft/Phi-3.5-MoE-instruct",),
        ),
    )
}



def _like(base: str, model_type: str, block_class: str, **changes) -> FamilySpec:
    """A family whose MoE block, router and experts are HF's ``base`` family's code under other class names
    (``moe_lab.families`` checks that by source); ``changes``: the registry fields that differ."""
    changes.setdefault("dense_target", None)
    changes.setdefault("real_checkpoints", ())
    return dataclasses.replace(_CORE[base], model_type=model_type, block_class=block_class, **changes)


_V3_NOTE = "DeepSeek-V3 routing (sigmoid, correction bias, group-limited top-2-sum, routed scaling)"
_ADDED: tuple[FamilySpec, ...] = (
    _like("qwen2_moe", "qwen3_next", "Qwen3NextSparseMoeBlock",
          dense_target=DenseTarget("one_expert", _one_expert("moe_intermediate_size", "num_experts")),
          notes="Qwen2-MoE block (sigmoid-gated shared expert) in a gated-DeltaNet / full-attention hybrid",
          real_checkpoints=("Qwen/Qwen3-Next-80B-A3B-Instruct",)),
    _like("qwen2_moe", "qwen3_5_moe_text", "Qwen3_5MoeSparseMoeBlock",
          dense_target=DenseTarget("one_expert", _one_expert("moe_intermediate_size", "num_experts")),
          routing_rule=functools.partial(_softmax_rule, renormalize=True),
          notes="Qwen2-MoE block, top-k always renormalised (no norm_topk_prob); gated-DeltaNet hybrid"),
    _like("qwen2_moe", "qwen4_exp_text", "Qwen4ExpTextSparseMoeBlock",
          dense_target=DenseTarget("one_expert", _one_expert("moe_intermediate_size", "num_experts")),
          notes="Qwen2-MoE block (sigmoid-gated shared expert) in a gated-DeltaNet hybrid"),
    _like("qwen3_moe", "mellum", "MellumSparseMoeBlock", notes="Qwen3-MoE block",
          dense_target=DenseTarget("one_expert", _one_expert("moe_intermediate_size", "num_local_experts"))),
    _like("olmoe", "flex_olmo", "FlexOlmoSparseMoeBlock", notes="OLMoE block",
          dense_target=DenseTarget("one_expert", _one_expert("intermediate_size", "num_experts")),
          real_checkpoints=("allenai/FlexOlmo-7x7B-1T",)),
    _like("mixtral", "minimax", "MiniMaxSparseMoeBlock", notes="Mixtral block in a lightning-attention hybrid",
          dense_target=DenseTarget("one_expert", _one_expert("intermediate_size", "num_local_experts")),
          real_checkpoints=("MiniMaxAI/MiniMax-Text-01",)),
    _like("deepseek_v3", "deepseek_v32", "DeepseekV32MoE", dense_target=_ALL_DENSE,
          notes=_V3_NOTE + "; sparse (indexer) attention",
          real_checkpoints=("deepseek-ai/DeepSeek-V3.2-Exp",)),
    _like("deepseek_v3", "sarvam_mla", "DeepseekV3MoE", dense_target=_ALL_DENSE,
          notes=_V3_NOTE + "; DeepSeek-V3 modeling code"),
    _like("deepseek_v3", "axk1", "AXK1MoE", output_norm_attr="post_mlp_layernorm",
          dense_target=DenseTarget("k_experts", _k_experts("num_local_experts")),
          notes=_V3_NOTE + "; an RMSNorm on the block output (post_mlp_layernorm)"),
    _like("deepseek_v3", "axk2", "AXK2MoE", routing_rule=_axk2_rule,
          dense_target=DenseTarget("k_experts", _k_experts("num_local_experts")),
          notes=_V3_NOTE + ", but dropped groups filled with 0.0 on the biased scores (AXK2's reference)"),
    _like("deepseek_v3", "hy_v4", "HYV4MoE", expert_act="apply_gate",
          dense_target=DenseTarget("k_experts", _k_experts("num_local_experts")),
          notes=_V3_NOTE + "; clamped-SwiGLU experts (swiglu_limit)"),
    _like("deepseek_v3", "dots1", "Dots1MoE", dense_target=_ALL_DENSE,
          notes=_V3_NOTE, real_checkpoints=("rednote-hilab/dots.llm1.inst",)),
    _like("deepseek_v3", "glm4_moe", "Glm4MoeMoE", dense_target=_ALL_DENSE,
          notes=_V3_NOTE, real_checkpoints=("zai-org/GLM-4.5-Air",)),
    _like("deepseek_v3", "glm4_moe_lite", "Glm4MoeLiteMoE", dense_target=_ALL_DENSE,
          notes=_V3_NOTE + "; MLA attention"),
    _like("deepseek_v3", "glm_moe_dsa", "GlmMoeDsaMoE", dense_target=_ALL_DENSE,
          notes=_V3_NOTE + "; sparse (indexer) attention"),
    _like("deepseek_v3", "sarvam_moe", "Glm4MoeMoE", dense_target=_ALL_DENSE,
          notes=_V3_NOTE + "; GLM-4-MoE modeling code"),
    _like("deepseek_v3", "solar_open", "SolarOpenMoE",
          dense_target=DenseTarget("k_experts", _k_experts("num_local_experts")), notes=_V3_NOTE),
    _like("deepseek_v3", "kimi_linear", "KimiLinearMoE", dense_target=_ALL_DENSE,
          notes=_V3_NOTE + "; KDA linear-attention hybrid",
          real_checkpoints=("moonshotai/Kimi-Linear-48B-A3B-Instruct",)),
    _like("deepseek_v3", "dots3_note_text", "Dots3NoteTextMoE", dense_target=_ALL_DENSE,
          notes=_V3_NOTE + "; indexed attention"),
    _like("deepseek_v3", "exaone_moe", "ExaoneMoeSparseMoEBlock", dense_target=_ALL_DENSE,
          notes=_V3_NOTE + "; sliding-window hybrid"),
    _like("deepseek_v3", "mimo_v2_flash", "MiMoV2FlashMoE", shared_attr=None, dense_target=_ALL_DENSE,
          notes=_V3_NOTE + "; no shared expert; sliding-window hybrid"),
    _like("mixtral", "jamba", "JambaSparseMoeBlock", router_attr="router", jitter_field=None,
          routing_rule=functools.partial(_softmax_rule, renormalize=False),
          dense_target=DenseTarget("mlp", _one_expert("intermediate_size", "num_experts"),
                                   note="num_experts=1 builds JambaMLP in every layer"),
          notes="softmax top-k, not renormalised; Mamba + attention hybrid, MoE every expert_layer_period layers"),
    _like("deepseek_v3", "bailing_hybrid", "BailingHybridMoE", dense_target=_ALL_DENSE,
          notes=_V3_NOTE + "; linear-attention hybrid"),
)
_ADDED_OWN: tuple[FamilySpec, ...] = tuple(
    FamilySpec(
        model_type, "GraniteMoeMoE" if model_type == "granitemoe" else f"{prefix}MoE", "router", _granite_rule,
        dense_target=DenseTarget("one_expert", _one_expert("intermediate_size", "num_local_experts")),
        notes="top-k on the (fp32-cast) logits, softmax over the top-k, weights in the input dtype" + extra,
    )
    for model_type, prefix, extra in (
        ("granitemoe", "GraniteMoe", ""),
        ("granitemoeshared", "GraniteMoeShared", "; shared MLP in the decoder layer, outside the MoE block"),
        ("granitemoe_swa", "GraniteMoeSWA", "; sliding-window attention layers"),
        ("granitemoehybrid", "GraniteMoeHybrid", "; Mamba-2 hybrid; shared MLP outside the MoE block"),
    )
)
_ADDED_OWN += (
    FamilySpec("flint", "FlintSparseMoeBlock", "gate", functools.partial(_fp32_rule, "sigmoid"),
               shared_attr="shared_expert",
               dense_target=_ALL_DENSE,
               notes="fp32 sigmoid top-k (renormalised), ungated shared expert; sliding-window hybrid"),
    FamilySpec("lara_mini", "LaraMiniSparseMoeBlock", "gate", functools.partial(_fp32_rule, "softmax"),
               shared_attr="shared_expert",
               dense_target=DenseTarget("one_expert", _one_expert("moe_intermediate_size", "num_experts")),
               notes="fp32 softmax top-k, weights in the input dtype, ungated shared expert; gated-DeltaNet / "
               "sliding / full hybrid"),
)
_ADDED_OWN += (
    FamilySpec("minimax_m2", "MiniMaxM2SparseMoeBlock", "gate", _minimax_m2_rule,
               correction_bias_attr="e_score_correction_bias", jitter_field="router_jitter_noise",
               dense_target=DenseTarget("one_expert", _one_expert("intermediate_size", "num_experts")),
               notes="sigmoid of the fp32-cast logits, selection bias held by the block, renormalised top-k"),
    FamilySpec("lfm2_moe", "Lfm2MoeSparseMoeBlock", "gate", _lfm2_moe_rule, correction_bias_attr="expert_bias",
               aux_loss="sequence", aux_loss_field=None,
               dense_target=_ALL_DENSE,
               notes="sigmoid top-k in the input dtype, optional selection bias held by the block (use_expert_bias), "
               "routed scaling; HF computes no aux loss (as DeepSeek-V3: native coefficient 0); short-conv hybrid"),
    FamilySpec("hy_v3", "HYV3MoE", "gate", _hy_v3_rule, shared_attr="shared_experts",
               correction_bias_attr="e_score_correction_bias", fp32_combine_field="enable_moe_fp32_combine",
               aux_loss="sequence", aux_loss_field=None,
               dense_target=_ALL_DENSE,
               notes="fp32 sigmoid top-k, selection bias held by the block, routed scaling, shared expert summed in "
               "fp32 (enable_moe_fp32_combine); HF computes no aux loss (native coefficient 0)"),
)
_ADDED_OWN += (
    FamilySpec("afmoe", "AfmoeSparseMoeBlock", "router", _afmoe_rule, router_weight_attr="gate.weight",
               shared_attr="shared_experts", shared_after_router=True, correction_bias_attr="expert_bias",
               aux_loss="sequence", aux_loss_field=None,
               dense_target=_ALL_DENSE,
               notes="sigmoid top-k of the fp32-cast logits, selection bias held by the block, route_scale, shared "
               "experts; router weight in a wrapped Linear; HF computes no aux loss (native coefficient 0)"),
    FamilySpec("hunyuan_v1_moe", "HunYuanMoEV1Moe", "gate", _hunyuan_rule, router_weight_attr="wg.weight",
               shared_attr="shared_mlp", shared_first=True, aux_loss="switch", aux_loss_field=None,
               dense_target=DenseTarget("k_experts", _k_experts("num_experts", "moe_topk")),
               notes="softmax top-k renormalised, router weight in a wrapped Linear (gate.wg; fp32 when kept so), "
               "shared MLP; HF computes no aux loss (native 0; an explicit coefficient adds the Switch loss)"),
)
_ADDED_OWN += (
    FamilySpec("ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", "gate", _ernie_rule, shared_attr="shared_experts",
               shared_first=True, correction_bias_attr="gate.moe_statics.e_score_correction_bias",
               dense_target=_ALL_DENSE,
               notes="fp32 softmax top-k selected with a [1, E] correction bias, renormalised (moe_norm_min), weights "
               "in the input dtype; shared experts (moe_num_shared_experts)"),
)
_ADDED_OWN += (
    FamilySpec("minimax_m3_vl_text", "MiniMaxM3VLSparseMoeBlock", "gate", _minimax_m3_rule,
               shared_attr="shared_experts", shared_first=True, expert_act="apply_gate",
               output_scaling_field="routed_scaling_factor",
               dense_target=DenseTarget("one_expert", _one_expert("intermediate_size", "num_experts")),
               notes="sigmoid of the fp32-cast logits + correction bias, renormalised; routed scaling on the mixture "
               "output; clamped-SwiGLU experts; shared expert"),
    FamilySpec("beam", "BeamMoE", "gate", _beam_rule, expert_act="apply_gate",
               output_scaling_field="routed_scaling_factor", aux_loss="sequence", aux_loss_field=None,
               dense_target=_ALL_DENSE,
               notes="fp32 sigmoid + correction bias, group-limited top-2-sum, routed scaling on the mixture output, "
               "fp32 gated activation; HF computes no aux loss (native coefficient 0)"),
)
_ADDED_OWN += (
    FamilySpec("laguna", "LagunaSparseMoeBlock", "gate", _laguna_rule, shared_attr="shared_experts", shared_first=True,
               output_scaling_field="moe_routed_scaling_factor",
               dense_target=_ALL_DENSE,
               notes="sigmoid + correction bias on soft-capped fp32-cast logits, renormalised, weights in the input "
               "dtype; routed scaling on the mixture output; shared expert"),
    FamilySpec("kolibri1", "Kolibri1SparseMoeBlock", "gate", _kolibri_rule, shared_attr="shared_experts",
               experts_own_view=True, aux_loss="sequence", aux_loss_field=None,
               dense_target=DenseTarget("one_expert", _one_expert("moe_intermediate_size", "num_experts")),
               notes="top-k of fp32 logits + correction bias, weights = sigmoid of the selected logits (renormalised); "
               "shared expert; HF computes no aux loss (native 0). On CUDA bf16 inference HF takes an fp32-output mm"),
)
_ADDED_OWN += (
    FamilySpec("cohere2_moe", "Cohere2MoeSparseMoeBlock", "gate", _cohere2_moe_rule, shared_attr="shared_experts",
               shared_combine_field="shared_expert_combination_strategy", aux_loss="switch", aux_loss_field=None,
               dense_target=DenseTarget("k_experts", _k_experts("num_experts")),
               notes="top-k of the logits, then an fp32 softmax over them (or their sigmoid, expert_selection_fn), "
               "weights in the input dtype; optional shared experts summed or averaged; HF computes no aux loss "
               "(native 0; an explicit coefficient adds the Switch loss)"),
)
_ADDED_OWN += (
    FamilySpec("inkling2_text", "Inkling2SparseMoeBlock", "gate", _inkling2_rule, expert_act="apply_gate",
               aux_loss="sequence", aux_loss_field=None,
               dense_target=DenseTarget("k_experts", _k_experts("n_routed_experts")),
               notes="fp32 sigmoid (scoring_func) top-k with the router's selection bias, renormalised, route_scale; "
               "softcapped-SwiGLU experts summed in fp32; no shared expert; HF computes no aux loss (native 0); "
               "sliding / full attention with block attention residuals"),
)
_ADDED_OWN += (
    FamilySpec("llama4_text", "Llama4TextMoe", "router", _llama4_rule, expert_layout="transposed",
               shared_attr="shared_expert", weight_on_input=True, router_logits_index=1, returns_router_logits=True,
               aux_loss="switch", aux_loss_field=None,
               notes="top-k (Llama 4: top-1) of the logits, sigmoid weight scaling the expert INPUT (every expert runs "
               "on its weight-scaled copy of the tokens), ungated shared expert; experts [E, H, 2I] applied as x @ W; "
               "MoE every interleave_moe_layer_step layers (moe_layers), chunked-attention / no-RoPE layers; HF "
               "computes no aux loss (native 0; an explicit coefficient adds the Switch loss)"),
    FamilySpec("dbrx", "DbrxFFN", "router", _dbrx_rule, router_weight_attr="layer.weight", expert_layout="w1_v1_w2",
               jitter_field="ffn_config.moe_jitter_eps", jitter_when_set=True,
               aux_loss_field="ffn_config.moe_loss_weight",
               aux_loss_model_attr="router_aux_loss_coef",
               expert_count_path="ffn_config.moe_num_experts", top_k_path="ffn_config.moe_top_k",
               dense_target=DenseTarget("one_expert", functools.partial(
                   _nested_overrides, "ffn_config.ffn_hidden_size", "ffn_config.moe_num_experts",
                   "ffn_config.moe_top_k"), note="no dense class has DBRX's backbone (clip_qkv Wqkv, bias-free "
                   "LayerNorms): one-expert DBRX"),
               notes="softmax top-k in the logits dtype, divided by the top-k's p-norm (ffn_config."
               "moe_normalize_expert_weights), training jitter (moe_jitter_eps); experts as w1 / v1 / w2 [E*I, H] "
               "in experts.mlp (LoRA: merged export, no PEFT adapter); clip_qkv attention",
               real_checkpoints=("transformers-community/dbrx-instruct",)),
)
_ADDED_OWN += (
    FamilySpec("aria_text", "AriaTextMoELayer", "router", _aria_rule, expert_layout="transposed",
               shared_attr="shared_experts", aux_loss="switch", aux_loss_field=None,
               expert_count_path="moe_num_experts", top_k_path="moe_topk",
               dense_target=DenseTarget("k_experts", _k_experts("moe_num_experts", "moe_topk"),
                                        note="intermediate_size also sizes the shared experts (times "
                                        "moe_num_shared_experts): k-expert Aria"),
               notes="top-k (moe_topk) of the logits, softmax over the top-k in the logits dtype, weights on the "
               "expert output; experts [E, H, 2I] applied as x @ W, always SiLU; ungated shared experts "
               "(moe_num_shared_experts x intermediate_size, hidden_act) added after them; HF computes no aux loss "
               "(native 0; an explicit coefficient adds the Switch loss)"),
)
# model_type -> why its family has no dense_target (every supported family has one or a reason here)
NO_DENSE_TARGET: dict[str, str] = {
    "phimoe": "no dense HF class has PhiMoE's backbone (LayerNorm with biases, optional attention and lm_head "
              "biases), and a routed PhiMoE student is not dense: its sparsemixer always routes 2 experts and, with a "
              "zeroed router, weighs them unequally (a masked softmax, then a softmax over the rest) and by Gumbel "
              "sampling in training",
    "llama4_text": "the conversion's dense FFN is the output-weighted sum of representatives, sum_g a_g E_g(x) "
                   "(docs/specs/compression.md); Llama 4's block computes E_e(w_e x), the routing weight on the expert "
                   "input, which no fixed scaling of a concatenated SwiGLU reproduces (the family's own all-dense "
                   "class, moe_layers=[], would be the target)",
}
FAMILIES: dict[str, FamilySpec] = {**_CORE, **{spec.model_type: spec for spec in _ADDED_OWN}, **{spec.model_type: spec for spec in _ADDED}}


def supported_families() -> list[str]:
    """The ``config.model_type`` values moe-lab supports."""
    return sorted(FAMILIES)


def family_spec(model_type: str) -> FamilySpec:
    """The registry entry for ``model_type``, with an error listing the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r}: moe-lab supports {', '.join(supported_families())}"
        ) from None
