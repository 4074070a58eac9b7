"""Token-level distillation losses (docs/specs/compression.md 2.9), computed in fp32 and chunked over tokens.

``kd_loss`` works on logits; ``chunked_head_kd`` takes the final hidden states of both models and applies
each ``lm_head`` per chunk of tokens, computing that chunk's gradient at once, so full-vocabulary fp32 logits of
the whole batch never exist (at most one chunk of each model at a time) and none is recomputed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KINDS = ("forward_kl", "reverse_kl", "jsd")


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kd loss kind={kind!r}: choose one of {', '.join(KINDS)} (method.options.loss)")


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "forward_kl",
                     temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """Per-token divergence [N] between softmax(logits / tau) of teacher and student, times tau^2, in fp32.

    forward_kl: KL(p_T || p_S); reverse_kl: KL(p_S || p_T); jsd: generalised JSD with mixture
    m = beta p_T + (1 - beta) p_S: beta KL(p_T || m) + (1 - beta) KL(p_S || m).
    """
    check_kind(kind)
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(f"student vocabulary {student_logits.shape[-1]} != teacher vocabulary "
                         f"{teacher_logits.shape[-1]}: distillation on logits needs one shared vocabulary")
    tau = float(temperature)
    log_s = F.log_softmax(student_logits.float() / tau, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / tau, dim=-1)
    if kind == "forward_kl":
        out = F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)
    elif kind == "reverse_kl":
        out = F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    else:
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd beta={beta} must be in (0, 1) (method.options.beta)")
        log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log(1.0 - beta))
        out = (beta * F.kl_div(log_m, log_t, reduction="none", log_target=True).sum(-1)
               + (1.0 - beta) * F.kl_div(log_m, log_s, reduction="none", log_target=True).sum(-1))
    return out * (tau * tau)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _mask(mask, n: int, device) -> torch.Tensor:
    if mask is None:
        return torch.ones(n, dtype=torch.bool, device=device)
    mask = mask.reshape(-1).to(device).bool()
    if mask.numel() != n:
        raise ValueError(f"mask has {mask.numel()} entries for {n} tokens")
    return mask


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "forward_kl",
            temperature: float = 1.0, mask: torch.Tensor | None = None, chunk_size: int | None = None,
            beta: float = 0.5, normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """Mean per-token divergence over real tokens (``mask`` 1), a scalar.

    ``normalizer``: divide the token sum by it instead of the mask's count (e.g. the real-token count of the
    whole accumulated global batch). ``chunk_size``: tokens per chunk (fp32 log-softmax of one chunk at a time).
    """
    s, t = _flat(student_logits), _flat(teacher_logits)
    keep = _mask(mask, s.shape[0], s.device)
    step = chunk_size or s.shape[0]
    total = s.new_zeros((), dtype=torch.float32)
    for i in range(0, s.shape[0], step):
        m = keep[i:i + step]
        total = total + token_divergence(s[i:i + step][m], t[i:i + step][m], kind, temperature, beta).sum()
    return total / (keep.sum() if normalizer is None else normalizer)


def _chunk_terms(h_s, h_t, keep, student_head, teacher_head, kind, temperature, beta, labels):
    logits_s = student_head(h_s)
    with torch.no_grad():
        logits_t = teacher_head(h_t)
    div = token_divergence(logits_s[keep], logits_t[keep], kind, temperature, beta).sum()
    top1 = (logits_s.detach()[keep].argmax(-1) == logits_t[keep].argmax(-1)).sum()
    ce = logits_s.new_zeros((), dtype=torch.float32)
    if labels is not None:
        ce = F.cross_entropy(logits_s.float(), labels, ignore_index=-100, reduction="sum")
    return div, ce, top1


def _plain_head(head, h: torch.Tensor) -> bool:
    """True when ``head(h)`` is exactly ``h @ W^T``: a bias-free ``nn.Linear`` (tied or not) without module or
    global hooks, a plain weight of h's dtype and device, outside autocast. Its gradients can then be written
    out (G W, G^T h); anything else (LoRA / peft wrappers, biases, sharded weights) goes through autograd."""
    w = getattr(head, "weight", None)
    global_hooks = getattr(torch.nn.modules.module, "_has_any_global_hook", lambda: True)
    return (type(head) is torch.nn.Linear and head.bias is None and type(w) in (torch.nn.Parameter, torch.Tensor)
            and w.dtype == h.dtype and w.device == h.device and not torch.is_autocast_enabled(h.device.type)
            and not (head._forward_hooks or head._forward_pre_hooks or head._backward_hooks
                     or head._backward_pre_hooks or global_hooks()))


def _buffer(bufs: dict, name: str, rows: int, cols: int, dtype, device) -> torch.Tensor:
    """The first ``rows`` rows of a [chunk, cols] buffer reused across chunks (sized by the first, largest
    chunk), so a chunk's full-vocabulary tensors need no fresh pages."""
    if name not in bufs or bufs[name].shape[1] != cols or bufs[name].dtype != dtype:
        bufs[name] = torch.empty(rows, cols, dtype=dtype, device=device)
    return bufs[name][:rows]


def _head_logits(head, h: torch.Tensor, plain: bool, bufs: dict, name: str) -> torch.Tensor:
    """``head(h)``; for a plain head ``h W^T`` written into a reused buffer."""
    if not plain:
        return head(h)
    w = head.weight.detach()
    return torch.mm(h, w.t(), out=_buffer(bufs, name, h.shape[0], w.shape[0], w.dtype, w.device))


def _fkl_terms(z_s, z_t, keep, drop, tau, own_s, bufs, want):
    """Forward KL of one chunk: ``(tau^2 sum over kept rows of KL(p_T || p_S), top-1 matches, G)`` with
    ``G = p_S - p_T`` (fp32, zero on dropped rows; the logit gradient of tau^2 KL is tau G). Per row
    KL = <p_T, z_T' - z_S'> - lse_T' + lse_S' (z' = z / tau, sum p_T = 1), lse = max - log p[argmax], so each
    model needs one max/argmax pass and one softmax pass. ``z_t`` is overwritten (it ends up holding G), ``z_s``
    only when ``own_s`` (and tau != 1)."""
    if z_s.dtype != torch.float32:
        z_s, own_s = z_s.float(), True
    if z_t.dtype != torch.float32:
        z_t = z_t.float()
    if tau != 1.0:
        z_s = z_s.div_(tau) if own_s else z_s / tau
        z_t = z_t.div_(tau)
    m_s, a_s = z_s.max(-1)
    m_t, a_t = z_t.max(-1)
    p_t = torch.softmax(z_t, -1, out=_buffer(bufs, "p", *z_t.shape, torch.float32, z_t.device))
    rows = z_t.sub_(z_s).mul_(p_t).sum(-1)  # <p_T, z_T' - z_S'>, in fp32 per row
    g = torch.softmax(z_s, -1, out=z_t)
    # lse_S' - lse_T' = m_S - m_T + log(p_T[argmax_T] / p_S[argmax_S]) (both >= 1 / V): one log per chunk
    rows += (m_s - m_t).add_((p_t.gather(1, a_t[:, None]) / g.gather(1, a_s[:, None])).squeeze(1).log_())
    match = a_s == a_t
    if drop is not None:
        rows, match = rows[keep], match[keep]
    if want:
        g.sub_(p_t)
        if drop is not None:
            g.index_fill_(0, drop, 0.0)
    return rows.sum() * (tau * tau), match.sum(), g


def _accumulate(acc: list, grads) -> None:
    for j, g in enumerate(grads):
        if g is not None:
            acc[j] = g if acc[j] is None else acc[j].add_(g)


def _fkl_chunks(hs, ht, keep, student_head, teacher_head, tau, w_div, step, want, params):
    """Forward KL without labels over all chunks, its logit gradient ``kd_weight * tau (p_S - p_T)`` written
    out (no elementwise backward graph). A plain bias-free Linear student head gets its gradients by two
    matmuls per chunk (``grad_h = G W``, ``grad_W += G^T h``, accumulated in place); any other head by one
    ``autograd.grad`` call per chunk. Returns ``(grad_h, [grad per param], divergence sum, top-1 matches)``."""
    direct = _plain_head(student_head, hs)
    plain_t = _plain_head(teacher_head, ht)
    grad_h = torch.empty_like(hs) if want else None
    grad_p = [None] * len(params)
    div = hs.new_zeros((), dtype=torch.float32)
    top1 = torch.zeros((), dtype=torch.long, device=hs.device)
    bufs: dict = {}
    for i in range(0, hs.shape[0], step):
        h, k = hs[i:i + step].detach(), keep[i:i + step]
        drop = None if bool(k.all()) else (~k).nonzero().squeeze(1)
        with torch.no_grad():
            z_t = _head_logits(teacher_head, ht[i:i + step], plain_t, bufs, "t")
            if direct:
                z_s = _head_logits(student_head, h, True, bufs, "s")
            else:
                h = h.requires_grad_(want)
                with torch.enable_grad():
                    logits_s = student_head(h)
                z_s = logits_s.detach()
            d, t, g = _fkl_terms(z_s, z_t, k, drop, tau, direct, bufs, want)
        div, top1 = div + d, top1 + t
        if not want:
            continue
        scale = w_div * tau
        if direct:
            w = student_head.weight.detach()
            g = g.to(w.dtype)
            grad_h[i:i + step].addmm_(g, w, beta=0, alpha=scale)
            if params:  # [weight]: G^T h summed over chunks in one buffer
                if grad_p[0] is None:
                    grad_p[0] = torch.empty_like(w).addmm_(g.t(), h, beta=0, alpha=scale)
                else:
                    grad_p[0].addmm_(g.t(), h, alpha=scale)
        else:
            g = g.mul_(scale).to(logits_s.dtype)
            grads = torch.autograd.grad(logits_s, [h, *params], grad_outputs=g, allow_unused=True)
            grad_h[i:i + step] = grads[0]
            _accumulate(grad_p, grads[1:])
    return grad_h, grad_p, div, top1


class _FusedChunks(torch.autograd.Function):
    """Loss sum over token chunks whose gradients (w.r.t. the student's hidden states and head parameters) are
    computed chunk by chunk in the forward pass, so no chunk's logits outlive it and nothing is recomputed.
    The gradients are handed to autograd once (backward with retain_graph a second time is refused), so the
    head's gradient buffer becomes ``.grad`` without a copy."""

    @staticmethod
    def forward(ctx, hs, ht, keep, labels, setup, *params):
        student_head, teacher_head, kind, temperature, beta, w_div, w_ce, step, want, analytic = setup
        ctx.want = want
        if analytic and kind == "forward_kl" and labels is None:
            grad_h, grad_p, div, top1 = _fkl_chunks(hs, ht, keep, student_head, teacher_head, temperature,
                                                    w_div, step, want, params)
            ce = torch.zeros_like(div)
            ctx.grads = [grad_h, *grad_p] if want else None
            ctx.mark_non_differentiable(div, ce, top1)
            return div * w_div, div, ce, top1
        grad_h = torch.zeros_like(hs) if want else None
        grad_p = [None] * len(params)
        total = hs.new_zeros((), dtype=torch.float32)
        div = total.clone()
        ce = total.clone()
        top1 = torch.zeros((), dtype=torch.long, device=hs.device)
        for i in range(0, hs.shape[0], step):
            lab = None if labels is None else labels[i:i + step]
            with torch.enable_grad():
                h = hs[i:i + step].detach().requires_grad_(want)
                d, c, t = _chunk_terms(h, ht[i:i + step], keep[i:i + step], student_head, teacher_head, kind,
                                       temperature, beta, lab)
                loss = w_div * d + w_ce * c
                if want:
                    grads = torch.autograd.grad(loss, [h, *params], allow_unused=True)
                    grad_h[i:i + step] = grads[0]
                    _accumulate(grad_p, grads[1:])
            total, div, ce, top1 = total + loss.detach(), div + d.detach(), ce + c.detach(), top1 + t
        ctx.grads = [grad_h, *grad_p] if want else None
        ctx.mark_non_differentiable(div, ce, top1)
        return total, div, ce, top1

    @staticmethod
    def backward(ctx, g_total, g_div, g_ce, g_top1):
        if not ctx.want:
            return (None,) * len(ctx.needs_input_grad)
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("chunked_head_kd: its gradients were computed in the forward pass and are handed "
                               "over once; backward through the same loss twice (retain_graph) is not supported")
        if not (g_total.device.type == "cpu" and bool(g_total == 1)):
            grads = [g if g is None else g.mul_(g_total) for g in grads]
        grad_h, *grad_p = grads
        return (grad_h, None, None, None, None, *grad_p)


def chunked_head_kd(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student_head, teacher_head,
                    kind: str = "forward_kl", temperature: float = 1.0, mask: torch.Tensor | None = None,
                    chunk_size: int | None = 1024, beta: float = 0.5, labels: torch.Tensor | None = None,
                    kd_weight: float = 1.0, ce_weight: float = 1.0, analytic_grad: bool = True):
    """Token SUMS ``(loss, divergence, cross-entropy, top-1 matches)`` from final hidden states, chunked.

    ``loss = kd_weight * divergence + ce_weight * cross-entropy`` carries the gradient (to the student's hidden
    states and head parameters); the other three are detached. Each chunk applies both heads, computes the fp32
    loss and its gradient at once and drops the logits, so at most one chunk of full-vocabulary logits of each
    model exists and none is recomputed in backward. ``labels`` (aligned with positions, -100 = ignored) add
    the student's cross-entropy; without them it is 0. ``analytic_grad`` (forward KL without labels): the logit
    gradient tau (p_S - p_T) is written out instead of autograd through the fp32 softmax/KL passes.
    """
    check_kind(kind)
    hs, ht = _flat(student_hidden), _flat(teacher_hidden)
    keep = _mask(mask, hs.shape[0], hs.device)
    flat_labels = None if labels is None else labels.reshape(-1)
    params = [p for p in student_head.parameters() if p.requires_grad]
    want = torch.is_grad_enabled() and (hs.requires_grad or bool(params))
    setup = (student_head, teacher_head, kind, float(temperature), float(beta), float(kd_weight),
             float(ce_weight), int(chunk_size or hs.shape[0]), want, bool(analytic_grad))
    return _FusedChunks.apply(hs, ht, keep, flat_labels, setup, *params)


HIDDEN_LAYER_REDUCTIONS = ("mean", "sum")


def hidden_mse_sum(student_states: list[torch.Tensor], teacher_states: list[torch.Tensor],
                   mask: torch.Tensor | None = None, layers: str = "mean") -> torch.Tensor:
    """Sum over real tokens of the per-token mean squared error over hidden units (fp32), averaged over the
    decoder layers (``layers="mean"``: one layer's scale whatever the depth; Minitron's intermediate loss is the
    mean over its layer pairs) or summed over them (``"sum"``)."""
    if layers not in HIDDEN_LAYER_REDUCTIONS:
        raise ValueError(f"hidden MSE layers={layers!r}: choose one of {', '.join(HIDDEN_LAYER_REDUCTIONS)}")
    if len(student_states) != len(teacher_states):
        raise ValueError(f"hidden MSE: student has {len(student_states)} decoder layers, teacher "
                         f"{len(teacher_states)}: fkl_hidden needs equal layer counts (use loss=forward_kl)")
    total = None
    for layer, (s, t) in enumerate(zip(student_states, teacher_states)):
        if s.shape[-1] != t.shape[-1]:
            raise ValueError(f"hidden MSE at layer {layer}: student hidden size {s.shape[-1]} != teacher "
                             f"{t.shape[-1]}: fkl_hidden needs equal hidden sizes (use loss=forward_kl)")
        s, t = _flat(s).float(), _flat(t).float()
        keep = _mask(mask, s.shape[0], s.device)
        term = ((s[keep] - t[keep]) ** 2).mean(-1).sum()
        total = term if total is None else total + term
    return total / len(student_states) if layers == "mean" else total
