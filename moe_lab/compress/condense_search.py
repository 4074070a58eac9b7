"""CD-MoE searches (docs/specs/compression.md 3.5-3.7): greedy expert selection per layer (paper Algorithm 1) with
cached candidate evaluation, greedy layer selection (Algorithm 2), and the baselines (random / L1 /
PL_Alpha_Hill experts; Layer Rank / Global Layer Rank layers; PPL / KL metrics; LayerTrim / BlockTrim).

``batches``: an iterable of dicts with ``input_ids`` and optional ``attention_mask`` (calibration sequences,
one per row); only real tokens enter every divergence (either padding side).

Resumable searches (each step can take minutes on a real model): ``done`` holds the steps a killed or signalled
run finished (they are taken as they are, not recomputed: every step depends only on the ones before it),
``progress`` is called as each new step finishes (to save it), and ``stop()`` true ends the search after the step
in hand (its partial result is returned; the caller exits and a re-run continues).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..moe.experts import expert_forward
from ..moe.view import MoELayerView
from .calibration import Calibration
from .condense import (
    build_condensed,
    check_layers,
    fixed_gates,
    flatten_real,
    moe_views,
    replace_module,
    sequence_mean,
    token_divergence,
)

EXPERT_BASELINES = ("greedy", "random", "l1", "alpha_hill")
LAYER_METHODS = ("greedy", "layer_rank", "global_layer_rank")
LAYER_METRICS = ("js", "kl", "ppl")


def candidate_count(num_experts: int, routed: int) -> int:
    """Candidate evaluations of the greedy expert search per layer: sum_{j<K_r} (E - j) (369 for 64, 6)."""
    return sum(num_experts - j for j in range(routed))


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _decoder_name(view: MoELayerView) -> str:
    return view.name.rpartition(".")[0]


def _backbone(model: nn.Module) -> nn.Module:
    return getattr(model, "base_model", model)


def _device(model: nn.Module):
    return next(model.parameters()).device


def _run(model: nn.Module, batch: dict, logits: bool = False):
    ids = batch["input_ids"].to(_device(model))
    mask = batch.get("attention_mask")
    mask = None if mask is None else mask.to(ids.device)
    if logits:
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return _backbone(model)(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state


@dataclass
class LayerCache:
    """One MoE layer on the calibration tokens (real tokens, fp32): block input ``x``, routed block output
    ``y``, decoder-layer output ``out``, sequence ids; expert outputs ``f`` [E, N, H] filled on demand."""

    x: torch.Tensor
    y: torch.Tensor
    out: torch.Tensor
    seq: torch.Tensor
    num_seqs: int
    f: torch.Tensor | None = None
    inputs: torch.Tensor | None = None  # decoder-layer input (BlockTrim's Block Influence)


@torch.no_grad()
def capture(model: nn.Module, batches, layers: Sequence[int] | None = None, block_inputs: bool = False
            ) -> dict[int, LayerCache]:
    """One pass of the (routed) model recording, at each MoE layer in ``layers`` (default all), the MoE-block
    input/output and the decoder-layer output on the real tokens."""
    views = moe_views(model)
    layers = sorted(views) if layers is None else check_layers(model, views, layers)
    parts: dict[int, dict[str, list]] = {i: {"x": [], "y": [], "out": [], "seq": [], "inputs": []} for i in layers}
    state = {"mask": None, "offset": 0}
    hooks = []

    def real(t):
        flat, seq, _ = flatten_real(t.float(), state["mask"])
        return flat, seq

    for i in layers:
        block = model.get_submodule(views[i].name)
        decoder = model.get_submodule(_decoder_name(views[i]))

        def block_hook(module, args, kwargs, output, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            parts[i]["x"].append(real(x)[0])
            parts[i]["y"].append(real(_first(output))[0])

        def decoder_hook(module, args, kwargs, output, i=i):
            flat, seq = real(_first(output))
            parts[i]["out"].append(flat)
            parts[i]["seq"].append(seq + state["offset"])
            if block_inputs:
                parts[i]["inputs"].append(real(args[0] if args else kwargs["hidden_states"])[0])

        hooks.append(block.register_forward_hook(block_hook, with_kwargs=True))
        hooks.append(decoder.register_forward_hook(decoder_hook, with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            state["mask"] = batch.get("attention_mask")
            _run(model, batch)
            state["offset"] += batch["input_ids"].shape[0]
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return {i: LayerCache(torch.cat(p["x"]), torch.cat(p["y"]), torch.cat(p["out"]), torch.cat(p["seq"]),
                          state["offset"], inputs=torch.cat(p["inputs"]) if block_inputs else None)
            for i, p in parts.items()}


def _loss(ref: torch.Tensor, tmp: torch.Tensor, cache: LayerCache, metric: str = "js") -> float:
    return float(sequence_mean(token_divergence(ref, tmp, metric), cache.seq, cache.num_seqs))


# greedy expert selection (spec 3.5) ---------------------------------------------------------------------------
class ExpertSearch:
    """Candidate losses of one layer. ``cached=True``: O_tmp = O_ref - y_ref + shared(x) + sum_C g f (expert
    outputs cached once); ``cached=False``: condense the layer in the model and run the full forward."""

    def __init__(self, model: nn.Module, calibration: Calibration, view: MoELayerView, cache: LayerCache,
                 batches, *, cached: bool = True, metric: str = "js", fallback: str = "exclude",
                 store_outputs: bool = True, hf_hidden_states: bool = False):
        self.model, self.calibration, self.view, self.cache = model, calibration, view, cache
        self.store_outputs = store_outputs
        # [CD-code] quirk (A4-1): HF's last hidden_states entry is post-final-norm, so the last layer's search
        # reads norm(output); off by default (the hook reads the layer output itself)
        last = view.index == model.config.num_hidden_layers - 1
        self.post = _backbone(model).norm if hf_hidden_states and last else None
        self.ref = self._post(cache.out)
        self.batches, self.cached, self.metric, self.fallback = batches, cached, metric, fallback
        self.gates, self.valid = fixed_gates(calibration, view.index, fallback)
        if cached:
            with torch.no_grad():
                dtype = view.expert_dtype
                x = cache.x.to(dtype)
                shared = build_condensed(view, None, [], gates=self.gates).shared_out(x)
                self.base = cache.out - cache.y + (0 if shared is None else shared.float())
                if cache.f is None and store_outputs:
                    cache.f = torch.stack([expert_forward(view, e, x).float() for e in range(view.num_experts)])

    def expert_output(self, e: int) -> torch.Tensor:
        """f_e on the calibration tokens [N, H] fp32: cached, or one expert forward (``store_outputs=False``:
        memory N*H instead of E*N*H)."""
        if self.cache.f is not None:
            return self.cache.f[e]
        return expert_forward(self.view, e, self.cache.x.to(self.view.expert_dtype)).float()

    @torch.no_grad()
    def _post(self, out: torch.Tensor) -> torch.Tensor:
        if self.post is None:
            return out
        return self.post(out.to(self.view.expert_dtype)).float()

    @torch.no_grad()
    def losses(self, chosen: Sequence[int]) -> torch.Tensor:
        """Loss [E] of condensing the layer to ``chosen`` + each candidate (inf: chosen or ineligible)."""
        E = self.view.num_experts
        out = torch.full((E,), math.inf, dtype=torch.float64)
        acc = None
        if self.cached:
            g = self.gates.float()
            acc = self.base.clone()
            for e in chosen:
                acc += g[e] * self.expert_output(e)
        for e in range(E):
            if e in chosen or not bool(self.valid[e]):
                continue
            if self.cached:
                tmp = acc + self.gates[e].float() * self.expert_output(e)
            else:
                tmp = self._forward([*chosen, e])
            out[e] = _loss(self.ref, self._post(tmp), self.cache, self.metric)
        return out

    def _forward(self, experts: list[int]) -> torch.Tensor:
        module = build_condensed(self.view, None, experts, gates=self.gates)
        return layer_output_with(self.model, self.view, module, self.batches)

    def run(self, routed: int) -> tuple[list[int], list[float]]:
        """The ordered greedy list of ``routed`` experts and the loss after each step (ties -> lower id)."""
        eligible = int(self.valid.sum())
        if routed > eligible:
            raise ValueError(f"layer {self.view.index}: condense.routed_experts={routed} but only {eligible} experts "
                             "have a fixed gate (the others were never selected on the calibration data): lower it "
                             "or set condense.fallback_gate=layer_mean|const")
        chosen, best = [], []
        for _ in range(routed):
            losses = self.losses(chosen)
            e = int(torch.argmin(losses))  # first minimum: lower index on ties
            chosen.append(e)
            best.append(float(losses[e]))
        return chosen, best


@torch.no_grad()
def layer_output_with(model: nn.Module, view: MoELayerView, module: nn.Module, batches) -> torch.Tensor:
    """Real-token decoder-layer output [N, H] (fp32) with ``view``'s block temporarily replaced by ``module``."""
    decoder = model.get_submodule(_decoder_name(view))
    outs, state = [], {"mask": None}

    def hook(mod, args, kwargs, output):
        outs.append(flatten_real(_first(output).float(), state["mask"])[0])

    handle = decoder.register_forward_hook(hook, with_kwargs=True)
    old = replace_module(model, view.name, module)
    try:
        for batch in batches:
            state["mask"] = batch.get("attention_mask")
            _run(model, batch)
    finally:
        replace_module(model, view.name, old)
        handle.remove()
    return torch.cat(outs)


def greedy_expert_search(model: nn.Module, calibration: Calibration, batches, routed: int,
                         layers: Sequence[int] | None = None, *, cached: bool = True, metric: str = "js",
                         fallback: str = "exclude", store_outputs: bool = True, hf_hidden_states: bool = False,
                         done: Mapping[int, tuple[list[int], list[float]]] | None = None,
                         progress: Callable[[int, list[int], list[float]], None] | None = None,
                         stop: Callable[[], bool] | None = None) -> dict[int, list[int]]:
    """Per MoE layer, the ordered greedy list of ``routed`` (K_r) experts minimising the JS at that layer's
    output (spec 3.5; other layers routed). Step losses are in ``result.losses`` ({layer: [float]}).
    ``store_outputs=False`` recomputes each candidate's expert output instead of keeping all E of them;
    ``hf_hidden_states=True`` reproduces [CD-code]'s post-final-norm reading at the last layer (A4-1).
    ``done`` / ``progress(layer, experts, losses)`` / ``stop``: one step per layer (module docstring)."""
    require_search_stats(calibration)
    calibration.check_compatible(model)
    batches = list(batches)
    views = moe_views(model)
    layers = sorted(views) if layers is None else check_layers(model, views, layers)
    result, losses, done = ExpertLists(), {}, done or {}
    for layer in layers:
        if layer in done:
            result[layer], losses[layer] = list(done[layer][0]), list(done[layer][1])
            continue
        cache = capture(model, batches, [layer])[layer]
        search = ExpertSearch(model, calibration, views[layer], cache, batches, cached=cached, metric=metric,
                              fallback=fallback, store_outputs=store_outputs, hf_hidden_states=hf_hidden_states)
        result[layer], losses[layer] = search.run(routed)
        del cache, search
        if progress is not None:
            progress(layer, result[layer], losses[layer])
        if stop is not None and stop():
            break
    result.losses = losses
    return result


class ExpertLists(dict):
    """``{layer: ordered expert ids}`` with the greedy's per-step ``losses`` ({layer: [float]})."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses: dict[int, list[float]] = {}


def require_search_stats(calibration: Calibration) -> None:
    from .condense import require_stats

    require_stats(calibration, ("w_sel", "count"), "the CD-MoE search (fixed gates)")


# expert-selection baselines (spec 3.7) ------------------------------------------------------------------------
ALPHA_HILL_XMIN = ("peak", "mid")


def alpha_hill(weight: torch.Tensor, k: int | None = None, xmin: str = "peak", bins: int = 100) -> float:
    """PL_Alpha_Hill of one matrix (paper Eq. 6): eigenvalues l_1 <= .. <= l_n of W^T W,
    alpha = 1 + k_h / sum_{i=1}^{k_h} ln(l_{n-i+1} / l_{n-k_h}). k_h: given ``k``; ``xmin="peak"`` (the paper's
    Fix-Finger, WeightWatcher's ``xmin_peak``): x_min = l_{n-k_h} ranges over the eigenvalues within
    [0.95, 1.5] x the left edge of the peak bin of a ``bins``-bin histogram of log10 l, and the k_h whose power
    law fits the tail best (smallest Kolmogorov-Smirnov distance) is kept; ``xmin="mid"``: k_h = floor(n/2)."""
    return alpha_hill_eigenvalues(torch.linalg.svdvals(weight.double()).pow(2), k, xmin, bins)


def alpha_hill_eigenvalues(eigenvalues: torch.Tensor, k: int | None = None, xmin: str = "peak",
                           bins: int = 100) -> float:
    """:func:`alpha_hill` from the eigenvalues of W^T W (any order)."""
    lam = eigenvalues.double().sort().values
    n = lam.numel()
    if k is not None or xmin == "mid":
        k = n // 2 if k is None else int(k)
        if not 1 <= k < n:
            raise ValueError(f"alpha_hill needs 1 <= k_h < n (n = {n}, k_h = {k})")
        return _hill(lam, k)
    if xmin != "peak":
        raise ValueError(f"condense.alpha_hill_xmin={xmin!r}: choose one of {', '.join(ALPHA_HILL_XMIN)}")
    log = torch.log10(lam.clamp_min(torch.finfo(torch.float64).tiny))
    counts = torch.histc(log, bins, min=float(log.min()), max=float(log.max()))
    edges = torch.linspace(float(log.min()), float(log.max()), bins + 1, dtype=torch.float64)
    peak = 10 ** float(edges[int(torch.argmax(counts))])
    lo, hi = 0.95 * peak, 1.5 * peak
    cand = [j for j in range(n - 1) if lo <= float(lam[j]) <= hi]  # x_min = lam[j], k_h = n - 1 - j above it
    if not cand:  # no eigenvalue in the window (degenerate spectrum): the middle
        return _hill(lam, n // 2)
    j = torch.tensor(cand)
    k_h = (n - 1 - j).double()
    logs = lam.log()
    above = logs.flip(0).cumsum(0).flip(0)  # above[t] = sum_{s >= t} log lam_s
    alpha = 1 + k_h / (above[j + 1] - k_h * logs[j])
    # Kolmogorov-Smirnov distance of each fit on its tail (rows: candidates; masked beyond each tail)
    pos = torch.arange(n, dtype=torch.float64)
    rank = pos[None, :] - j[:, None].double()  # 1..k_h on the tail
    on_tail = (rank >= 1)
    ratio = torch.where(on_tail, lam[None, :] / lam[j][:, None], torch.ones(1, dtype=torch.float64))
    fit = 1 - ratio.pow(1 - alpha[:, None])
    emp = rank / k_h[:, None]
    gap = torch.maximum((fit - emp).abs(), (fit - emp + 1 / k_h[:, None]).abs())
    dist = torch.where(on_tail, gap, torch.zeros(1, dtype=torch.float64)).amax(1)
    return float(alpha[int(torch.argmin(dist))])


def _hill(lam: torch.Tensor, k: int) -> float:
    n = lam.numel()
    return 1.0 + k / float(torch.log(lam[n - k:] / lam[n - k - 1]).sum())


def expert_baseline(model: nn.Module, calibration: Calibration, method: str, routed: int,
                    layers: Sequence[int] | None = None, seed: int = 0, fallback: str = "exclude",
                    xmin: str = "peak") -> dict[int, list[int]]:
    """``routed`` experts per layer by ``random`` (seeded), ``l1`` (smallest sum |W| over gate, up, down) or
    ``alpha_hill`` (lowest mean alpha over the three matrices, k_h by ``xmin``: :func:`alpha_hill`);
    never-selected experts excluded like the greedy."""
    if method not in EXPERT_BASELINES[1:]:
        raise ValueError(f"condense.expert_selection={method!r}: choose one of {', '.join(EXPERT_BASELINES)}")
    views = moe_views(model)
    layers = sorted(views) if layers is None else check_layers(model, views, layers)
    out = {}
    for layer in layers:
        view = views[layer]
        _, valid = fixed_gates(calibration, layer, fallback)
        gate, up, down = (t.detach() for t in view.roles())  # [E, I, H], [E, I, H], [E, H, I] views
        if method == "random":
            gen = torch.Generator().manual_seed(seed * 100003 + layer)
            score = torch.rand(view.num_experts, generator=gen, dtype=torch.float64)
        elif method == "l1":
            score = sum(t.double().abs().sum((1, 2)) for t in (gate, up, down)).cpu()
        else:
            score = torch.tensor([sum(alpha_hill(w[e], xmin=xmin) for w in (gate, up, down)) / 3
                                  for e in range(view.num_experts)], dtype=torch.float64)
        score = torch.where(valid, score, torch.full_like(score, math.inf))
        order = torch.sort(score, stable=True).indices.tolist()
        out[layer] = order[:routed]
    return out


# layer selection (spec 3.6, 3.7) ------------------------------------------------------------------------------
class LayerSearch:
    """Final-output losses of condensing sets of layers (each layer's module built once)."""

    def __init__(self, model: nn.Module, calibration: Calibration, batches, experts: Mapping[int, Sequence[int]],
                 *, target: str = "hidden_softmax", metric: str = "js", fallback: str = "exclude",
                 layers: Sequence[int] | None = None):
        if metric not in LAYER_METRICS:
            raise ValueError(f"condense.metric={metric!r}: choose one of {', '.join(LAYER_METRICS)}")
        require_search_stats(calibration)
        calibration.check_compatible(model)
        self.model, self.batches, self.target, self.metric = model, list(batches), target, metric
        self.views = moe_views(model)
        self.layers = sorted(self.views) if layers is None else check_layers(model, self.views, layers)
        self.modules = {i: build_condensed(self.views[i], calibration, list(experts.get(i, [])), fallback)
                        for i in self.layers}
        self.ref = self._outputs()

    @torch.no_grad()
    def _outputs(self) -> list[torch.Tensor]:
        logits = self.target == "vocab" or self.metric == "ppl"
        was = self.model.training
        self.model.eval()
        try:
            return [_run(self.model, b, logits=logits).float() for b in self.batches]
        finally:
            self.model.train(was)

    def loss(self, layers: Sequence[int]) -> float:
        """Loss of condensing ``layers`` together (JS / KL at the final output, or mean perplexity change)."""
        old = {i: replace_module(self.model, self.views[i].name, self.modules[i]) for i in layers}
        try:
            outs = self._outputs()
        finally:
            for i, module in old.items():
                replace_module(self.model, self.views[i].name, module)
        if self.metric == "ppl":  # mean over SEQUENCES (every batch size weighs its rows, not one mean per batch)
            return float(torch.cat([_ppl(o, b) - _ppl(r, b) for o, r, b in
                                    zip(outs, self.ref, self.batches)]).mean())
        values, seqs, offset = [], [], 0
        for o, r, b in zip(outs, self.ref, self.batches):
            ro, seq, n = flatten_real(r, b.get("attention_mask"))
            values.append(token_divergence(ro, flatten_real(o, b.get("attention_mask"))[0], self.metric))
            seqs.append(seq + offset)
            offset += n
        return float(sequence_mean(torch.cat(values), torch.cat(seqs), offset))

    def greedy(self, n_layers: int, done: Sequence[tuple[int, float]] = (),
               progress: Callable[[int, int, float], None] | None = None,
               stop: Callable[[], bool] | None = None) -> tuple[list[int], list[float]]:
        """Ordered layer list (paper Algorithm 2; ties -> lower layer) and the loss after each step. ``done``:
        the (layer, loss) of the first steps; ``progress(step, layer, loss)`` / ``stop``: module docstring."""
        if not 0 <= n_layers <= len(self.layers):
            raise ValueError(f"condense.num_layers={n_layers} must be in [0, {len(self.layers)}] (MoE layers)")
        done = list(done)[:n_layers]
        chosen, best = [int(i) for i, _ in done], [float(v) for _, v in done]
        while len(chosen) < n_layers:
            losses = {i: self.loss([*chosen, i]) for i in self.layers if i not in chosen}
            layer = min(losses, key=lambda i: (losses[i], i))
            chosen.append(layer)
            best.append(losses[layer])
            if progress is not None:
                progress(len(chosen) - 1, layer, losses[layer])
            if stop is not None and stop():
                break
        return chosen, best

    def single_losses(self, done: Mapping[int, float] | None = None,
                      progress: Callable[[int, float], None] | None = None,
                      stop: Callable[[], bool] | None = None) -> dict[int, float]:
        """``{layer: loss of condensing it alone}`` at the final output (the paper's Figs. 2 and 5).
        ``done`` / ``progress(layer, loss)`` / ``stop``: module docstring."""
        out = {}
        for i in self.layers:
            if done and i in done:
                out[i] = float(done[i])
                continue
            out[i] = self.loss([i])
            if progress is not None:
                progress(i, out[i])
            if stop is not None and stop():
                break
        return out

    def global_rank(self, **resume) -> list[int]:
        """Global Layer Rank: each layer condensed alone, final-output loss ascending (``resume``: the
        ``done`` / ``progress`` / ``stop`` of :meth:`single_losses`)."""
        losses = self.single_losses(**resume)
        return sorted(losses, key=lambda i: (losses[i], i))


def _ppl(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Each sequence's perplexity [B] (next-token NLL over real targets)."""
    ids = batch["input_ids"].to(logits.device)
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.to(ids.device)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    valid = (mask[:, 1:] * mask[:, :-1]).float()
    return torch.exp((nll * valid).sum(1) / valid.sum(1).clamp_min(1))


def layer_rank(model: nn.Module, calibration: Calibration, batches, experts: Mapping[int, Sequence[int]],
               fallback: str = "exclude") -> list[int]:
    """Layer Rank: each layer condensed alone, JS at THAT layer's output, ascending (ties -> lower layer)."""
    require_search_stats(calibration)
    views = moe_views(model)
    caches = capture(model, list(batches))
    losses = {}
    for i, cache in caches.items():
        module = build_condensed(views[i], calibration, list(experts.get(i, [])), fallback)
        with torch.no_grad():
            y = module(cache.x.to(views[i].expert_dtype).unsqueeze(0))
            tmp = cache.out - cache.y + _first(y).squeeze(0).float()
        losses[i] = _loss(cache.out, tmp, cache)
    return sorted(losses, key=lambda i: (losses[i], i))


def active_params(model: nn.Module) -> int:
    """Parameters one token uses: all parameters minus, in every still-routed MoE layer, the E - k experts it
    does not select (condensed layers: every retained expert is active; trimmed ones have none)."""
    total = sum(p.numel() for p in model.parameters())
    try:
        routed = moe_views(model).values()
    except ValueError:  # every MoE layer condensed or trimmed: no routed layer is left
        routed = []
    for view in routed:
        per_expert = sum(t[0].numel() for t in view.expert_parameters().values())
        total -= (view.num_experts - view.top_k) * per_expert
    return total


# LayerTrim / BlockTrim (spec 3.7, He et al. 2024) -----------------------------------------------------------
class DroppedFFN(nn.Module):
    """A removed MoE sub-block (LayerTrim): contributes nothing to the residual stream."""

    def __init__(self, returns_router_scores: bool = False):
        super().__init__()
        self.returns_router_scores = returns_router_scores

    def forward(self, hidden_states):
        out = torch.zeros_like(hidden_states)
        return (out, None) if self.returns_router_scores else out


class DroppedBlock(nn.Module):
    """A removed decoder block (BlockTrim): returns its input hidden states."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def block_influence(model: nn.Module, batches, unit: str = "moe") -> dict[int, float]:
    """BI = 1 - mean_t cos(input_t, output_t) per MoE layer over real tokens: ``moe`` = the FFN sub-block
    (input = the residual entering it), ``block`` = the whole decoder block."""
    if unit not in ("moe", "block"):
        raise ValueError(f"trim unit={unit!r}: choose moe (LayerTrim) or block (BlockTrim)")
    caches = capture(model, list(batches), block_inputs=unit == "block")
    out = {}
    for i, c in caches.items():
        source = c.out - c.y if unit == "moe" else c.inputs
        out[i] = 1.0 - float(torch.nn.functional.cosine_similarity(source.double(), c.out.double(), dim=-1).mean())
    return out


def trim(model: nn.Module, layers: Sequence[int], unit: str = "moe") -> nn.Module:
    """Drop the MoE sub-blocks (``moe``, LayerTrim) or whole decoder blocks (``block``, BlockTrim) of
    ``layers`` in place."""
    views = moe_views(model)
    for i in check_layers(model, views, layers):
        if unit == "moe":
            replace_module(model, views[i].name, DroppedFFN(views[i].spec.returns_router_scores))
        else:
            replace_module(model, _decoder_name(views[i]), DroppedBlock())
    return model


def trim_order(model: nn.Module, batches, unit: str = "moe") -> list[int]:
    """MoE layers by ascending Block Influence (removed first), ties -> lower layer."""
    bi = block_influence(model, batches, unit)
    return sorted(bi, key=lambda i: (bi[i], i))
