"""CD-MoE / ConDense-MoE (docs/specs/compression.md 3.1-3.4, 3.8): fixed gates, the condensed layer, the JS divergence
the search uses, and export / reload of condensed models.

``condense(model, calibration, layers=[...], experts={layer: [ids]})`` replaces the MoE block of each listed
decoder layer by a :class:`CondensedLayer`: shared path + sum_i g_i E_i(x) over the retained experts for EVERY
token (no router), g_i the fixed gate of spec 3.2 (a buffer). ``export_condensed`` writes only the retained
experts; ``load_condensed`` rebuilds the model from that directory (works for every family; the condensed
layers are not a vanilla HF architecture in general: e.g. DeepSeek-V2 has no per-layer dense FFN width).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ..core.export_check import CONDENSE_FILE
from ..core.precision import config_in_load_dtype, in_load_dtype, load_dtype
from ..moe.support import refuse_undefined
from ..moe.view import MoELayerView, find_moe_layers
from .calibration import Calibration

JS_EPS = 1e-10
TARGETS = ("hidden_softmax", "vocab")
FALLBACKS = ("exclude", "layer_mean", "const")
CODE_FALLBACK_GATE = 0.06  # [CD-code]'s gate for never-selected experts


# fixed gates (spec 3.2) ---------------------------------------------------------------------------------------
def fixed_gates(calibration: Calibration, layer: int, fallback: str = "exclude",
                const: float = CODE_FALLBACK_GATE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gates [E] float64, valid [E] bool)`` of one MoE layer: g_i = w_sel[i] / count[i], the mean applied
    gate over the calibration tokens that selected i. Never-selected experts: ``exclude`` (valid=False, gate
    0: not a search candidate), ``layer_mean`` (mean gate of the selected ones) or ``const`` (``const``,
    0.06 as [CD-code])."""
    if fallback not in FALLBACKS:
        raise ValueError(f"condense.fallback_gate={fallback!r}: choose one of {', '.join(FALLBACKS)}")
    require_stats(calibration, ("w_sel", "count"), "CD-MoE fixed gates")
    if layer not in calibration.layers:
        raise ValueError(f"layer {layer} is not an MoE layer of the calibration file (MoE layers: "
                         f"{calibration.moe_layers}): condense.layers may only name MoE layers")
    stats = calibration.layers[layer]
    count = stats["count"].double()
    selected = count > 0
    gates = torch.where(selected, stats["w_sel"].double() / count.clamp_min(1), torch.zeros_like(count))
    if fallback == "exclude" or bool(selected.all()):
        return gates, selected
    fill = gates[selected].mean() if fallback == "layer_mean" and bool(selected.any()) else torch.tensor(const, dtype=torch.float64)
    return torch.where(selected, gates, fill.double()), torch.ones_like(selected)


def require_stats(calibration: Calibration, names: Sequence[str], user: str) -> None:
    """Refuse a calibration file lacking ``names`` (naming them and the consumer)."""
    missing = sorted({n for stats in calibration.layers.values() for n in names if n not in stats})
    if missing:
        raise ValueError(f"calibration file lacks statistic(s) {missing} needed by {user}: recalibrate with the "
                         "current task=calibrate")


# JS divergence (spec 3.4) -----------------------------------------------------------------------------------
def _kl_eps(a: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """sum_h (a+eps)(log(a+eps) - log(b+eps)) over the last dim."""
    a, b = a + eps, b + eps
    return (a * (a.log() - b.log())).sum(-1)


def token_divergence(ref: torch.Tensor, tmp: torch.Tensor, metric: str = "js", eps: float = JS_EPS) -> torch.Tensor:
    """Per-token divergence [N] between softmax(ref) and softmax(tmp) over the last dim (fp32): ``js`` (spec
    3.4) or ``kl`` (KL(ref || tmp), spec 3.7)."""
    u = torch.softmax(ref.float(), dim=-1)
    v = torch.softmax(tmp.float(), dim=-1)
    if metric == "kl":
        return _kl_eps(u, v, eps)
    if metric != "js":
        raise ValueError(f"condense.metric={metric!r}: choose js or kl (ppl only for the layer search)")
    m = (u + v) * 0.5
    return 0.5 * _kl_eps(u, m, eps) + 0.5 * _kl_eps(v, m, eps)


def sequence_mean(values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """(1/N_s) sum_j mean_{t in seq j} values[t]: per-sequence batchmean, each sequence weighted equally."""
    sums = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add_(0, seq_ids, values)
    counts = torch.bincount(seq_ids, minlength=num_seqs).to(values.dtype)
    keep = counts > 0
    return (sums[keep] / counts[keep]).mean()


def flatten_real(t: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(rows [N, D], seq ids [N], number of sequences)`` of the real tokens of ``t`` [B, T, D]."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
        mask = None if mask is None else mask.reshape(1, -1)
    B, T, D = t.shape
    seq = torch.arange(B, device=t.device).repeat_interleave(T)
    flat = t.reshape(-1, D)
    if mask is not None:
        keep = mask.reshape(-1).to(t.device).bool()
        flat, seq = flat[keep], seq[keep]
    return flat, seq, B


def js_divergence(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None,
                  target: str = "hidden_softmax", metric: str = "js") -> torch.Tensor:
    """CD-MoE's Jensen-Shannon divergence (spec 3.4): softmax over the last dim of ``a`` and ``b`` [B, T, D]
    (or [T, D]) in fp32, JS per token with eps = 1e-10, mean over each sequence's real tokens (``mask`` [B, T],
    either padding side), mean over sequences. ``target``: ``hidden_softmax`` (D = hidden size, [CD-code]) or
    ``vocab`` (D = vocabulary: pass logits, the paper's "model output")."""
    if target not in TARGETS:
        raise ValueError(f"condense.target={target!r}: choose one of {', '.join(TARGETS)}")
    if a.shape != b.shape:
        raise ValueError(f"js_divergence needs equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    ra, seq, n = flatten_real(a, mask)
    rb, _, _ = flatten_real(b, mask)
    return sequence_mean(token_divergence(ra, rb, metric), seq, n)


# the condensed layer (spec 3.3) -------------------------------------------------------------------------------
class CondensedLayer(nn.Module):
    """Shared path + sum_{i in C} g_i E_i(x) for every token: the retained experts' packed slices
    (``gate_up_proj`` [K, 2I, H], ``down_proj`` [K, H, I]), fixed gates ``gates`` [K] and the retained ids
    ``expert_ids`` [K] as buffers, the family's shared expert (and its sigmoid gate) as submodules. The gates
    stay fp32 whatever the model dtype (``.to(bf16)`` included) and scale the expert activations in fp32.
    Stateless (no counters, no files), so activation checkpointing and batched evaluation are safe."""

    def __init__(self, view: MoELayerView, experts: Sequence[int], gates: torch.Tensor):
        super().__init__()
        refuse_undefined("condense", view.spec, view.rule)
        ids = torch.tensor([int(e) for e in experts], dtype=torch.long)
        if ids.numel() != len(set(ids.tolist())) or bool(((ids < 0) | (ids >= view.num_experts)).any()):
            raise ValueError(f"layer {view.index}: retained experts {ids.tolist()} must be distinct ids in "
                             f"[0, {view.num_experts}) (condense.routed_experts)")
        gate, up, down = (t.detach() for t in view.roles())  # views in every layout (DBRX: w1 / v1 / w2 rows)
        dev = gate.device
        idx = ids.to(dev)
        self.gate_up_proj = nn.Parameter(torch.cat([gate[idx], up[idx]], dim=1))  # copies of the retained slices
        self.down_proj = nn.Parameter(down[idx].contiguous())
        self.register_buffer("gates", gates.detach().to(device=dev, dtype=torch.float32).clone())
        self.register_buffer("expert_ids", ids.to(dev))
        self.act_fn = view.layout.activation(view.experts)
        self.shared_attr = view.spec.shared_attr
        self.shared_gate_attr = view.spec.shared_gate_attr
        self.returns_router_scores = view.spec.returns_router_scores
        self.index = view.index
        if self.shared_attr:
            self.add_module(self.shared_attr, view.shared)
        if self.shared_gate_attr:
            self.add_module(self.shared_gate_attr, view.shared_gate)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """sum_i g_i E_i(x) [N, H] (zeros for K = 0)."""
        if not self.expert_ids.numel():
            return torch.zeros_like(x)
        gate, up = torch.einsum("nh,kih->kni", x, self.gate_up_proj).chunk(2, dim=-1)
        act = self.act_fn(gate) * up
        act = (act.float() * self.gates.view(-1, 1, 1)).to(act.dtype)
        return torch.einsum("kni,khi->nh", act, self.down_proj)

    def _apply(self, fn, recurse=True):
        gates = self.gates
        super()._apply(fn, recurse)
        self._buffers["gates"] = gates.to(device=self.gates.device, dtype=torch.float32)  # casts skip the gates
        return self

    def shared_out(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared path (Qwen2-MoE: with its token-wise sigmoid gate), None without shared experts."""
        if not self.shared_attr:
            return None
        out = getattr(self, self.shared_attr)(x)
        if self.shared_gate_attr:
            out = torch.sigmoid(getattr(self, self.shared_gate_attr)(x)) * out
        return out

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        out = self.routed(x)
        shared = self.shared_out(x)
        if shared is not None:
            out = out + shared
        out = out.reshape(shape)
        return (out, None) if self.returns_router_scores else out

    def extra_repr(self) -> str:
        return f"layer={self.index}, experts={self.expert_ids.tolist()}"


# condensing a model -------------------------------------------------------------------------------------------
def moe_views(model: nn.Module) -> dict[int, MoELayerView]:
    """``{decoder layer: view}`` of the model's (still routed) MoE layers."""
    return {v.index: v for v in find_moe_layers(model)}


def check_layers(model: nn.Module, views: Mapping[int, MoELayerView], layers: Sequence[int]) -> list[int]:
    """Validated decoder-layer indices: each must be an MoE layer of the model (dense layers are refused)."""
    out = []
    for layer in layers:
        layer = int(layer)
        if layer not in views:
            kind = "dense" if 0 <= layer < model.config.num_hidden_layers else "out of range"
            raise ValueError(f"condense.layers names decoder layer {layer}, which is {kind}: only MoE layers "
                             f"can be condensed (MoE layers: {sorted(views)})")
        out.append(layer)
    if len(set(out)) != len(out):
        raise ValueError(f"condense.layers={list(layers)} repeats a layer")
    return out


def build_condensed(view: MoELayerView, calibration: Calibration | None, experts: Sequence[int],
                    fallback: str = "exclude", gates: torch.Tensor | None = None) -> CondensedLayer:
    """The condensed module of one layer (gates from ``calibration`` unless ``gates`` [E] is given)."""
    experts = [int(e) for e in experts]
    if gates is None and not experts:  # CD-MoE-S: shared path only, no gate needed
        gates = torch.zeros(view.num_experts, dtype=torch.float64)
    if gates is None:
        if calibration is None:
            raise ValueError("condensing with retained experts needs a calibration file (fixed gates)")
        gates, valid = fixed_gates(calibration, view.index, fallback)
        bad = [e for e in experts if not bool(valid[e])]
        if bad:
            raise ValueError(f"layer {view.index}: experts {bad} were never selected on the calibration data, so "
                             "they have no fixed gate: drop them or set condense.fallback_gate=layer_mean|const")
    ids = torch.tensor(experts, dtype=torch.long)
    return CondensedLayer(view, experts, gates.index_select(0, ids) if experts else gates[:0])


def replace_module(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Put ``module`` at path ``name``; returns the previous module."""
    parent, _, child = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, child)
    setattr(owner, child, module)
    return old


def condense(model: nn.Module, calibration: Calibration | None, layers: Sequence[int],
             experts: Mapping[int, Sequence[int]] | int | None = None, *, fallback: str = "exclude",
             ) -> nn.Module:
    """Condense ``layers`` (decoder indices of MoE layers) of ``model`` in place and return it.

    experts: ``{layer: ordered retained ids}`` (CD-MoE-SR; lists from :func:`greedy_expert_search`), or None / 0
    for CD-MoE-S (shared path only). ``model.moe_lab_condense`` records layers, experts and gates.
    """
    if calibration is not None and not getattr(model, "moe_lab_condense", None):
        calibration.check_compatible(model)  # (a second call sees fewer MoE layers than were calibrated)
    views = moe_views(model)
    layers = check_layers(model, views, layers)
    experts = {} if experts is None or isinstance(experts, int) and experts == 0 else experts
    if isinstance(experts, int):
        raise TypeError("condense(experts=int) only accepts 0 (CD-MoE-S); pass {layer: [ids]} for CD-MoE-SR")
    record = dict(getattr(model, "moe_lab_condense", {}) or {})
    for layer in layers:
        module = build_condensed(views[layer], calibration, experts.get(layer, []), fallback)
        replace_module(model, views[layer].name, module)
        record[str(layer)] = {"experts": module.expert_ids.tolist(), "gates": module.gates.double().tolist(),
                              "name": views[layer].name}
    model.moe_lab_condense = record
    return model


# export / reload ----------------------------------------------------------------------------------------------
def write_manifest(model: nn.Module, path, extra: dict | None = None) -> Path:
    """Write ``condense_manifest.json`` (layers, retained expert ids, gates, dtype) into ``path``."""
    record = getattr(model, "moe_lab_condense", None)
    if not record:
        raise ValueError("a condensed export needs a model returned by condense() or load_condensed()")
    manifest = {"method": "cd_moe", "dtype": str(load_dtype(model)).removeprefix("torch."),
                "layers": record, **(extra or {})}
    target = Path(path) / CONDENSE_FILE
    target.write_text(json.dumps(manifest, indent=1))
    return target


def export_condensed(model: nn.Module, path, tokenizer=None, extra: dict | None = None) -> Path:
    """Write a condensed model: config (the original architecture), ONLY the retained experts' weights and
    ``condense_manifest.json`` (layers, expert ids, gates). Every tensor is written in the model's load dtype
    (``precision.in_load_dtype``: fp32 master weights of a condense_sft run are cast back once; buffers HF keeps
    in fp32 stay fp32), the dtype ``config.json`` and the manifest state. Reload with :func:`load_condensed`.
    Atomic (:func:`~moe_lab.moe.patch.atomic_export`): ``path`` is replaced only by a complete export, so a kill
    never leaves weights without their manifest."""
    from ..moe.patch import atomic_export

    if not getattr(model, "moe_lab_condense", None):
        raise ValueError("export_condensed needs a model returned by condense()")
    return atomic_export(path, lambda tmp: write_condensed(model, tmp, tokenizer, extra))


def write_condensed(model: nn.Module, path, tokenizer=None, extra: dict | None = None) -> Path:
    """:func:`export_condensed`'s files written into the directory ``path`` as they are (no atomic swap): only for a
    folder that is itself being written atomically (an export hook's temporary folder)."""
    from safetensors.torch import save_file

    record = getattr(model, "moe_lab_condense", None)
    if not record:
        raise ValueError("export_condensed needs a model returned by condense()")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    config_in_load_dtype(model, path)
    state = {k: v.detach().cpu().contiguous() for k, v in in_load_dtype(model, model.state_dict()).items()}
    for info in record.values():  # the fixed gates stay fp32 (CondensedLayer)
        state[f"{info['name']}.gates"] = model.get_submodule(info["name"]).gates.detach().cpu().float()
    seen: dict[int, str] = {}
    for key in list(state):  # tied weights: store once (safetensors refuses shared storage)
        ptr = state[key].untyped_storage().data_ptr()
        if ptr in seen and state[key].numel():
            state[key] = state[key].clone()
        seen.setdefault(ptr, key)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_manifest(model, path, extra)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load_condensed(path, device=None, dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild a model written by :func:`export_condensed` (strict: every tensor comes from the file) in
    ``dtype`` (default: the manifest's), buffers HF keeps in fp32 in fp32."""
    import transformers
    from safetensors.torch import load_file

    from .dense import build_uninitialised

    path = Path(path)
    if not (path / CONDENSE_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {CONDENSE_FILE}: pass a directory written by export_condensed")
    manifest = json.loads((path / CONDENSE_FILE).read_text())
    config = transformers.AutoConfig.from_pretrained(path)
    model = build_uninitialised(config, dtype or getattr(torch, manifest["dtype"]))
    views = moe_views(model)
    for layer, info in manifest["layers"].items():
        view = views[int(layer)]
        E = view.num_experts
        gates = torch.zeros(E, dtype=torch.float64)
        gates[torch.tensor(info["experts"], dtype=torch.long)] = torch.tensor(info["gates"], dtype=torch.float64)
        replace_module(model, view.name, build_condensed(view, None, info["experts"], gates=gates))
    state = {}
    for file in sorted(path.glob("*.safetensors")):  # one file (export_condensed) or save_pretrained shards
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight") or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ValueError(f"{path}: condensed checkpoint does not match its manifest (missing {missing}, "
                         f"unexpected {unexpected})")
    model.moe_lab_condense = manifest["layers"]
    if device is not None:
        model.to(device)
    return model.eval()


__all__ = ["CondensedLayer", "condense", "export_condensed", "fixed_gates", "js_divergence", "load_condensed",
           "write_condensed"]



def _constant_shared(layer: CondensedLayer, model_type: str) -> tuple[nn.Module, float] | None:
    """A condensed layer's shared expert and its constant gate value (:func:`to_vanilla`), None without one;
    refuses a token-wise gate, which one vanilla dense MLP cannot express."""
    if not layer.shared_attr:
        return None
    expert = getattr(layer, layer.shared_attr)
    if not all(hasattr(expert, p) for p in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError(f"{model_type}: the shared expert is no gate/up/down MLP: use export_condensed")
    if not layer.shared_gate_attr:
        return expert, 1.0
    gate = getattr(layer, layer.shared_gate_attr)
    if getattr(gate, "bias", None) is not None or bool(gate.weight.any()):
        raise ValueError(f"{model_type}: condensed layers keep the shared expert with its token-wise sigmoid gate "
                         "(Qwen2-MoE), which one vanilla dense MLP cannot express: use export_condensed")
    return expert, 0.5  # sigmoid(0), exactly


@torch.no_grad()
def to_vanilla(model: nn.Module) -> nn.Module:
    """The condensed model as a VANILLA HF model of its own family, where the family allows per-layer dense FFNs
    (a config with ``mlp_only_layers``, e.g. Qwen3-MoE, Qwen2-MoE) and the condensed layers' shared expert, if
    any, has a constant gate: each condensed layer becomes a dense SwiGLU of width S + K_r*I (the shared expert's
    S rows, its down block scaled by the constant gate, then the retained experts' blocks scaled by g_i), every
    dense FFN zero-padded to the common ``intermediate_size`` (exact). A constant gate is none, or a bias-free
    sigmoid gate whose weight is all zeros (sigmoid(0) = 0.5 exactly): DeepSeekMoE converted to Qwen2-MoE by
    ``moe_lab.convert``. A token-wise gate (a trained Qwen2-MoE): :func:`export_condensed`."""
    from .dense import build_uninitialised

    record = getattr(model, "moe_lab_condense", None)
    config = model.config
    if not record:
        raise ValueError("to_vanilla needs a model returned by condense() or load_condensed()")
    if not hasattr(config, "mlp_only_layers"):
        raise ValueError(f"{config.model_type} has no per-layer dense FFN (mlp_only_layers): export with "
                         "export_condensed and reload with load_condensed")
    layers = {int(i): model.get_submodule(info["name"]) for i, info in record.items()}
    shared = {i: _constant_shared(m, config.model_type) for i, m in layers.items()}
    widths = [m.down_proj.shape[0] * m.down_proj.shape[2] + (s[0].down_proj.weight.shape[1] if s else 0)
              for m, s in zip(layers.values(), shared.values())]
    dense_before = [int(i) for i in config.mlp_only_layers]
    width = max([*widths, int(config.intermediate_size) if dense_before else 0, 1])
    values = config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "_name_or_path"):
        values.pop(key, None)
    values.update({"mlp_only_layers": sorted({*dense_before, *layers}), "intermediate_size": width})
    vanilla = build_uninitialised(type(config)(**values), load_dtype(model))
    vanilla.to(next(model.parameters()).device).eval()
    source = model.state_dict()
    prefixes = {record[str(i)]["name"] + "." for i in layers}
    for name, tensor in vanilla.state_dict().items():
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None:
            continue
        src = source[name]
        tensor.zero_()
        tensor[tuple(slice(0, s) for s in src.shape)].copy_(src)  # dense layers: zero-padded (exact)
    for i, module in layers.items():
        mlp = vanilla.get_submodule(record[str(i)]["name"])
        gate, up = module.gate_up_proj.chunk(2, dim=1)  # [K, I, H] each
        K, I, H = gate.shape
        down = (module.down_proj * module.gates.view(-1, 1, 1)).permute(1, 0, 2).reshape(H, K * I)
        gate, up = gate.reshape(K * I, H), up.reshape(K * I, H)
        if shared[i]:  # the shared expert's rows first, its down block times the constant gate (exact: 0.5 or 1)
            expert, factor = shared[i]
            gate = torch.cat([expert.gate_proj.weight, gate])
            up = torch.cat([expert.up_proj.weight, up])
            down = torch.cat([expert.down_proj.weight * factor, down], dim=1)
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.weight.zero_()
        mlp.gate_proj.weight[: gate.shape[0]].copy_(gate)
        mlp.up_proj.weight[: up.shape[0]].copy_(up)
        mlp.down_proj.weight[:, : down.shape[1]].copy_(down)
    vanilla.moe_lab_manifest = {"method": "cd_moe", "layers": record}
    return vanilla
