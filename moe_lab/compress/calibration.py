"""Calibration: one streamed pass of the unmodified MoE model recording, per MoE layer, every statistic of
docs/specs/compression.md section 1; saved as one safetensors file and reused by every scoring/sweep.

``Calibration.layers[layer]`` (decoder layer index -> dict) holds EXACTLY these tensors (sums over the
real, non-pad calibration tokens t; E experts, H hidden size; accumulators float64, counts int64):

```text
==================  ========  =============================================================================
name                shape     definition
==================  ========  =============================================================================
n                   [] int64  number of real tokens
count               [E] int64 sum_t 1[e in S(t)]  (S = the family's own top-k set, ``select_topk``)
p_sum               [E]       sum_t p_e(t)        (p = softmax over ALL E router logits, fp32; sigmoid
                                                   routers: the family's per-expert scores, manifest
                                                   ``p_definition``)
p_sel               [E]       sum_t 1[e in S(t)] p_e(t)
w_sel               [E]       sum_t w_e(t)        (w = the weight the family applies, 0 off the set)
sq_norm             [E]       sum_t ||f_e(t)||^2 over ALL tokens (== diag(gram) exactly)
gram                [E, E]    sum_t <f_i(t), f_j(t)> over all tokens
wnorm_sel           [E]       sum_t w_e(t) ||f_e(t)||
norm_sel            [E]       sum_t 1[e in S(t)] ||f_e(t)||
norm_all            [E]       sum_t ||f_e(t)||
out_sum             [E, H]    sum_t f_e(t)
seq_act             [E]       sum_j (1/L_j) sum_{t in seq j} 1[e in S(t)]       (ES-Act numerator)
seq_mag             [E]       sum_j (1/L_j) sum_{t in seq j} ||w_e(t) f_e(t)||  (ES-Mag, gated)
seq_mag_ungated     [E]       sum_j (1/L_j) sum_{t in seq j} ||f_e(t)||         (ES-Mag, ungated)
num_seqs            [] int64  number of sequences (batch rows) with at least one real token
router_weight       [E, H]    fp32 copy of the router weight
router_bias         [E]       fp32 router logit bias (only where the family has one, e.g. GPT-OSS)
e_score_correction_bias [E]   fp32 selection-only bias (only DeepSeek-V3 style routers)
==================  ========  =============================================================================
```

f_e(t) is the UNWEIGHTED output of routed expert e on the MoE-block input x(t) (model dtype, upcast to fp32
before norms and inner products). Sequence j = one batch row; L_j its real-token count.

``Calibration.manifest`` keys: model (name_or_path), revision, model_type, num_hidden_layers, moe_layers,
num_experts, top_k, hidden_size, moe_intermediate_size, data {source, sha256 (chained over the real token ids of
every sequence, independent of batching)}, num_sequences, seq_len, tokens, dtype, p_definition, format_version, complete,
batches_done.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

log = logging.getLogger(__name__)

from ..core.atomic import atomic_write
from ..moe import routing
from ..moe.experts import expert_forward, expert_intermediate_size
from ..moe.routing import router_logits, select_topk
from ..moe.stats import TokenContext
from ..moe.view import MoELayerView, find_moe_layers

FORMAT_VERSION = 1

# statistic -> the scores / consumers that read it (used in error messages)
REQUIRED_BY: dict[str, tuple[str, ...]] = {
    "n": ("all scores",),
    "count": ("sf", "cp", "acp", "do_cp", "do_acp", "reap", "ean_mean", "fixed gates"),
    "p_sum": ("pp",),
    "p_sel": ("ps", "cp", "acp", "do_cp", "do_acp"),
    "w_sel": ("CD-MoE fixed gates",),
    "sq_norm": ("acp", "do_acp"),
    "gram": ("do_cp", "do_acp", "oc grouping", "effective rank"),
    "wnorm_sel": ("reap",),
    "norm_sel": ("ean_mean", "ean_sum"),
    "norm_all": ("es_mag (ungated, pooled)",),
    "out_sum": ("mean-output features",),
    "seq_act": ("es_act",),
    "seq_mag": ("es_mag",),
    "seq_mag_ungated": ("es_mag variant=ungated",),
    "num_seqs": ("es_act", "es_mag"),
    "router_weight": ("rc grouping", "ab grouping"),
}
ACCUMULATED = (
    "p_sum", "p_sel", "w_sel", "sq_norm", "wnorm_sel", "norm_sel", "norm_all",
    "seq_act", "seq_mag", "seq_mag_ungated",
)
MANIFEST_KEY = "moe_lab_calibration"


@dataclass
class Calibration:
    """Per-MoE-layer calibration statistics (see the module docstring for every field)."""

    manifest: dict
    layers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    # persistence ------------------------------------------------------------------------------
    def save(self, path) -> Path:
        """Write one safetensors file (manifest JSON in its metadata) atomically; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            f"layers.{layer}.{name}": t.detach().cpu().contiguous()
            for layer, stats in self.layers.items()
            for name, t in stats.items()
        }
        metadata = {MANIFEST_KEY: json.dumps(self.manifest, sort_keys=True)}
        return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))

    @classmethod
    def load(cls, path, field: str | None = None) -> Calibration:
        """Read a file written by :meth:`save`; ``field``: the setting that named it (for the errors)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"calibration file {str(path)!r} does not exist: run task=calibrate first")
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as err:
            partial = path.with_name("calibration.partial.safetensors")
            resume = (f", or continue its partial with compress.calibration.resume_from={partial}"
                      if partial.is_file() and partial != path else "")
            fix = (f"Recalibrate with task=calibrate (the same command again with hydra.run.dir=<its run dir> "
                   f"continues a calibration that was interrupted){resume}")
            if field == "compress.calibration.resume_from":  # the partial itself: it cannot be continued
                fix = (f"It cannot be continued: delete {path} and drop {field} to calibrate from the first batch")
            raise ValueError(
                f"{field or 'compress.calibration_file (or condense.calibration_file)'}={path}: the file is truncated "
                f"or corrupted ({err}). {fix}") from None
        if MANIFEST_KEY not in metadata:
            raise ValueError(f"{path} is not a moe-lab calibration file (no {MANIFEST_KEY!r} metadata)")
        manifest = json.loads(metadata[MANIFEST_KEY])
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path} has calibration format_version {manifest.get('format_version')}, this moe-lab reads "
                f"{FORMAT_VERSION}: recalibrate with task=calibrate"
            )
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            _, layer, name = key.split(".", 2)
            layers.setdefault(int(layer), {})[name] = tensor
        return cls(manifest, dict(sorted(layers.items())))

    # checks -------------------------------------------------------------------------------------
    def check_compatible(self, model: nn.Module, what: str = "calibration file",
                         fix: str = "recalibrate this model with task=calibrate") -> None:
        """Raise ValueError unless this calibration was taken on ``model`` (name, revision, layer and expert
        counts, MoE layer indices, router weights); ``what`` names the file, ``fix`` is the advice."""
        m = self.manifest
        expected = model_manifest(model)
        for key in ("model", "revision", "model_type", "num_hidden_layers", "moe_layers", "num_experts",
                    "top_k", "hidden_size"):
            if m.get(key) != expected.get(key):
                raise ValueError(
                    f"{what} is for {key}={m.get(key)!r} (model {m.get('model')!r}, revision "
                    f"{m.get('revision')!r}) but the model has {key}={expected.get(key)!r}: {fix}"
                )
        lower_precision = set()
        for view in find_moe_layers(model):
            stored = self.layers[view.index].get("router_weight")
            live = view.router_weight.detach().cpu()
            if stored is None or torch.equal(stored, live.float()):
                continue
            if live.dtype != stored.dtype and torch.equal(stored.to(live.dtype), live):
                lower_precision.add(str(live.dtype).removeprefix("torch."))  # the same weights, rounded
                continue
            raise ValueError(
                f"{what}, layer {view.index}: the model's router weights differ from the calibrated ones (another "
                f"revision or a fine-tuned model?): {fix}"
            )
        if lower_precision:
            log.warning("calibration %s was taken on this model's weights at float32; the model now runs in %s "
                        "(model.dtype): its statistics come from the float32 model", m.get("model"),
                        ", ".join(sorted(lower_precision)))

    def require(self, *names: str, score: str | None = None) -> None:
        """Raise unless every MoE layer holds the statistics ``names``, all finite (naming the missing
        statistic and the score that needs it, or the layer and expert of a NaN/inf)."""
        for layer, stats in self.layers.items():
            for name in names:
                if name not in stats:
                    users = score or ", ".join(REQUIRED_BY.get(name, ("?",)))
                    raise ValueError(
                        f"calibration file lacks statistic {name!r} (layer {layer}) needed by score {users}: "
                        "recalibrate with the current task=calibrate"
                    )
                value = stats[name]
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    bad = (~torch.isfinite(value)).nonzero()[0].tolist()
                    where = f"expert {bad[0]}" if value.dim() >= 1 else "scalar"
                    raise ValueError(
                        f"calibration statistic {name!r} is not finite at layer {layer}, {where} "
                        f"(index {bad}): the calibration pass overflowed; recalibrate in float32"
                    )

    @property
    def moe_layers(self) -> list[int]:
        return list(self.layers)


def model_manifest(model: nn.Module) -> dict:
    """The model-identifying part of a calibration manifest."""
    config = model.config
    views = find_moe_layers(model)
    view = views[0]
    return {
        "model": getattr(config, "name_or_path", "") or "",
        "revision": getattr(config, "_commit_hash", None),
        "model_type": config.model_type,
        "num_hidden_layers": int(config.num_hidden_layers),
        "moe_layers": [v.index for v in views],
        "num_experts": view.num_experts,
        "top_k": view.top_k,
        "hidden_size": int(config.hidden_size),
        "moe_intermediate_size": expert_intermediate_size(view),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "p_definition": "sigmoid_scores" if view.rule.score == "sigmoid" else "softmax_all",
    }


def routing_probabilities(view: MoELayerView, logits: torch.Tensor) -> torch.Tensor:
    """p_e(t) [N, E] fp32: softmax over all E logits; for sigmoid routers the sigmoid affinities."""
    return routing.routing_probabilities(view.rule, logits)


def chunk_size(view: MoELayerView, max_chunk_tokens: int, memory_budget_mb: float) -> int:
    """Tokens per dense all-expert chunk: the fp32 block F [E, T_c, H] plus one expert's intermediates
    must fit ``memory_budget_mb``."""
    E, H, I = view.num_experts, view.router_weight.shape[1], expert_intermediate_size(view)
    per_token = 4 * (E * H + 4 * I + 2 * H) + 8 * E * 8
    return max(1, min(int(max_chunk_tokens), int(memory_budget_mb * 2**20) // per_token))


def empty_stats(view: MoELayerView) -> dict[str, torch.Tensor]:
    """Zero accumulators of one layer (float64 sums, int64 counts) plus router copies."""
    E, H = view.num_experts, view.router_weight.shape[1]
    f64 = {"dtype": torch.float64}
    stats = {
        "n": torch.zeros((), dtype=torch.long),
        "count": torch.zeros(E, dtype=torch.long),
        "gram": torch.zeros(E, E, **f64),
        "out_sum": torch.zeros(E, H, **f64),
        "num_seqs": torch.zeros((), dtype=torch.long),
        **{name: torch.zeros(E, **f64) for name in ACCUMULATED},
        "router_weight": view.router_weight.detach().float().cpu().clone(),
    }
    if view.router_bias is not None:
        stats["router_bias"] = view.router_bias.detach().float().cpu().clone()
    if view.rule.uses_correction_bias and view.correction_bias is not None:
        stats["e_score_correction_bias"] = view.correction_bias.detach().float().cpu().clone()
    return stats


def _block(workspace: dict | None, shape: tuple[int, int, int], device) -> torch.Tensor:
    """A contiguous fp32 [E, T_c, H] block, carved from a buffer reused across chunks, layers and batches
    (a fresh large allocation per chunk costs page faults comparable to the statistics themselves)."""
    numel = shape[0] * shape[1] * shape[2]
    if workspace is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    buf = workspace.get(device)
    if buf is None or buf.numel() < numel:
        buf = workspace[device] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf[:numel].view(shape)


@torch.no_grad()
def accumulate(view: MoELayerView, stats: dict, x: torch.Tensor, logits: torch.Tensor, seq_id: torch.Tensor,
               inv_len: torch.Tensor, chunk_tokens: int, workspace: dict | None = None) -> None:
    """Add the statistics of real tokens ``x`` [N, H] (router ``logits`` [N, E], sequence ids, 1/L_j);
    ``workspace`` (a dict) keeps the dense-output buffer between calls."""
    dev = x.device
    p = routing_probabilities(view, logits).double()
    weights, indices = select_topk(view.rule, logits, False, view.correction_bias)
    E = view.num_experts
    w = torch.zeros(x.shape[0], E, dtype=torch.float64, device=dev).scatter_(1, indices, weights.double())
    sel = torch.zeros(x.shape[0], E, dtype=torch.bool, device=dev).scatter_(1, indices, True)
    selected = sel.double()
    inv = inv_len.double()[:, None]
    acc = {name: torch.zeros_like(stats[name], device=dev) for name in ("gram", "out_sum", *ACCUMULATED)}
    acc["p_sum"] += p.sum(0)
    acc["p_sel"] += (p * selected).sum(0)
    acc["w_sel"] += w.sum(0)
    acc["seq_act"] += (selected * inv).sum(0)
    for start in range(0, x.shape[0], chunk_tokens):
        xs = x[start:start + chunk_tokens]
        F = _block(workspace, (E, xs.shape[0], x.shape[1]), dev)
        for e in range(E):
            F[e] = expert_forward(view, e, xs)
        flat = F.reshape(E, -1)
        gram = (flat @ flat.T).double()
        gram = (gram + gram.T) * 0.5  # exactly symmetric whatever the GEMM kernel's blocking (diagonal unchanged)
        acc["gram"] += gram
        acc["sq_norm"] += gram.diagonal()
        acc["out_sum"] += F.sum(1).double()
        norms = torch.linalg.vector_norm(F, dim=-1).double().T  # [T_c, E]
        ws, ss, iv = w[start:start + chunk_tokens], selected[start:start + chunk_tokens], inv[start:start + chunk_tokens]
        acc["wnorm_sel"] += (ws * norms).sum(0)
        acc["norm_sel"] += (ss * norms).sum(0)
        acc["norm_all"] += norms.sum(0)
        acc["seq_mag"] += (ws.abs() * norms * iv).sum(0)
        acc["seq_mag_ungated"] += (norms * iv).sum(0)
    for name, value in acc.items():
        stats[name] += value.cpu()
    stats["count"] += sel.sum(0).cpu()
    stats["n"] += x.shape[0]
    stats["num_seqs"] += int(torch.unique(seq_id).numel())


class _Recorder:
    """Forward pre-hooks on the HF MoE blocks that accumulate statistics while calibrating."""

    def __init__(self, views: list[MoELayerView], context: TokenContext, layers: dict, chunk_tokens: dict):
        self.views, self.context, self.layers, self.chunk_tokens = views, context, layers, chunk_tokens
        self.workspace: dict = {}

    def hook(self, view: MoELayerView):
        def pre_hook(module, args, kwargs):
            if not self.context.calibrating:
                return
            hidden = args[0] if args else kwargs["hidden_states"]
            batch, seq, H = hidden.shape
            mask = self.context.token_mask(batch, seq)
            x = hidden.reshape(-1, H)
            # logits on the whole block input, as the HF block computes them (GEMM rounding depends on the
            # row count, and threshold rules such as sparsemixer are sensitive to the last bit)
            logits = router_logits(view.rule, x, view.router_weight, view.router_bias)
            rows = torch.arange(batch, device=x.device).repeat_interleave(seq)
            if mask is not None:
                mask = mask.to(x.device)
                x, logits, rows = x[mask], logits[mask], rows[mask]
            lengths = torch.bincount(rows, minlength=batch)
            inv_len = 1.0 / lengths.double()[rows]
            accumulate(view, self.layers[view.index], x, logits, rows, inv_len, self.chunk_tokens[view.index],
                       self.workspace)
        return pre_hook


def _batch_digest(previous: str, batch: dict) -> str:
    """sha256 chained over the real tokens of every sequence (independent of batching and pad content)."""
    ids = batch["input_ids"].detach().cpu().to(torch.int64)
    mask = batch.get("attention_mask")
    for row in range(ids.shape[0]):
        real = ids[row] if mask is None else ids[row][mask[row].detach().cpu().bool()]
        h = hashlib.sha256(previous.encode())
        h.update(real.contiguous().numpy().tobytes())
        previous = h.hexdigest()
    return previous


@torch.no_grad()
def calibrate(
    model: nn.Module,
    batches: Iterable[dict],
    *,
    max_chunk_tokens: int = 2048,
    memory_budget_mb: float = 2048,
    progress: Callable[[int, int], None] | None = None,
    resume_from=None,
    partial_path=None,
    save_every: int = 0,
    data_source: str = "",
    manifest_extra: dict | None = None,
) -> Calibration:
    """One pass of the unmodified ``model`` over ``batches`` (dicts with ``input_ids`` and optional
    ``attention_mask``; each row = one sequence), recording every statistic at every MoE layer.

    Dense all-expert outputs are computed in chunks of at most ``max_chunk_tokens`` real tokens whose fp32
    block fits ``memory_budget_mb``. ``progress(batches_done, tokens)`` is called after each batch. With
    ``partial_path`` and ``save_every=N`` the state is written atomically every N batches; pass that file
    as ``resume_from`` (with the same batches) to continue where it stopped: the result is identical.
    """
    if any(type(m).__name__ == "MoEBlock" for m in model.modules()):
        raise ValueError("calibrate() needs the unmodified HF model: remove the moe-lab patch first (patch.remove())")
    views = find_moe_layers(model)
    manifest = {**model_manifest(model), "format_version": FORMAT_VERSION, "complete": False,
                "batches_done": 0, "tokens": 0, "num_sequences": 0, "seq_len": 0,
                "data": {"source": data_source, "sha256": ""}, **(manifest_extra or {})}
    if resume_from is not None:
        partial = Calibration.load(resume_from, field="compress.calibration.resume_from")
        owner = partial.manifest.get("model_config") or partial.manifest.get("model")
        partial.check_compatible(model, what=f"the partial calibration {resume_from} (it belongs to model {owner})",
                                 fix=f"continue it with model={owner}, or delete {resume_from} (or calibrate into "
                                     "another hydra.run.dir) to calibrate this model from the start")
        layers = partial.layers
        manifest.update({k: partial.manifest[k] for k in ("batches_done", "tokens", "num_sequences", "seq_len")})
        manifest["data"]["sha256"] = partial.manifest["data"]["sha256"]
    else:
        layers = {view.index: empty_stats(view) for view in views}
    chunk_tokens = {v.index: chunk_size(v, max_chunk_tokens, memory_budget_mb) for v in views}
    context = TokenContext()
    recorder = _Recorder(views, context, layers, chunk_tokens)
    backbone = getattr(model, "base_model", model)
    hooks = [view.block.register_forward_pre_hook(recorder.hook(view), with_kwargs=True) for view in views]
    hooks += [backbone.register_forward_pre_hook(context.capture, with_kwargs=True),
              backbone.register_forward_hook(context.release, with_kwargs=True)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32 in the Gram matrix and norms (spec 0.3)
    skip, prefix = manifest["batches_done"], ""
    try:
        with context.calibration():
            for i, batch in enumerate(batches):
                if i < skip:  # already in the resumed state: only check that it is the same data
                    prefix = _batch_digest(prefix, batch)
                    if i + 1 == skip and prefix != manifest["data"]["sha256"]:
                        raise ValueError(f"resume_from={str(resume_from)!r} was written on other calibration data "
                                         "(its first batches differ): resume with the same data and settings")
                    continue
                ids = batch["input_ids"].to(device)
                mask = batch.get("attention_mask")
                mask = None if mask is None else mask.to(device)
                backbone(input_ids=ids, attention_mask=mask, use_cache=False)
                real = int(mask.sum()) if mask is not None else ids.numel()
                manifest["data"]["sha256"] = _batch_digest(manifest["data"]["sha256"], batch)
                manifest["batches_done"] = i + 1
                manifest["tokens"] += real
                manifest["num_sequences"] += ids.shape[0]
                manifest["seq_len"] = max(manifest["seq_len"], ids.shape[1])
                if progress is not None:
                    progress(i + 1, manifest["tokens"])
                if partial_path is not None and save_every and (i + 1) % save_every == 0:
                    Calibration(dict(manifest), layers).save(partial_path)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
        torch.set_float32_matmul_precision(precision)
    if manifest["batches_done"] == 0:
        raise ValueError("calibrate() got no batches: check compress.calibration.num_sequences and the dataset")
    manifest["complete"] = True
    return Calibration(manifest, layers)
