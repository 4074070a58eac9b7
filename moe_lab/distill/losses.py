"""Token-level distillation losses (spec compression.md 2.9), computed in fp32 and chunked over tokens.

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


def _fkl_chunk(h_s, h_t, keep, student_head, teacher_head, temperature, w_div, want, params):
    """Forward-KL chunk with its gradient written out: d(tau^2 KL(p_T || p_S))/dz_S = tau (p_S - p_T) per kept
    row (0 elsewhere), pushed through the student head by one autograd call (no elementwise backward graph)."""
    tau = float(temperature)
    with torch.enable_grad():
        logits_s = student_head(h_s)
    with torch.no_grad():
        logits_t = teacher_head(h_t)
        all_kept = bool(keep.all())
        z_s, z_t = (logits_s.detach(), logits_t) if all_kept else (logits_s.detach()[keep], logits_t[keep])
        top1 = (z_s.argmax(-1) == z_t.argmax(-1)).sum()
        log_s = F.log_softmax(z_s.float() / tau, dim=-1)
        log_t = F.log_softmax(z_t.float() / tau, dim=-1)
        p_t = log_t.exp()
        div = (p_t * (log_t - log_s)).sum() * (tau * tau)
        grads = None
        if want:
            g = log_s.exp_().sub_(p_t).mul_(w_div * tau).to(logits_s.dtype)
            if not all_kept:
                g = torch.zeros_like(logits_s).index_put_((keep,), g)
    if want:
        grads = torch.autograd.grad(logits_s, [h_s, *params], grad_outputs=g, allow_unused=True)
    return div, top1, grads


class _FusedChunks(torch.autograd.Function):
    """Loss sum over token chunks whose gradients (w.r.t. the student's hidden states and head parameters) are
    computed chunk by chunk in the forward pass, so no chunk's logits outlive it and nothing is recomputed."""

    @staticmethod
    def forward(ctx, hs, ht, keep, labels, setup, *params):
        student_head, teacher_head, kind, temperature, beta, w_div, w_ce, step, want, analytic = setup
        analytic = analytic and kind == "forward_kl" and labels is None
        grad_h = torch.zeros_like(hs) if want else None
        grad_p = [torch.zeros_like(p) for p in params] if want else []
        total = hs.new_zeros((), dtype=torch.float32)
        div = total.clone()
        ce = total.clone()
        top1 = torch.zeros((), dtype=torch.long, device=hs.device)
        for i in range(0, hs.shape[0], step):
            lab = None if labels is None else labels[i:i + step]
            if analytic:
                h = hs[i:i + step].detach().requires_grad_(want)
                d, t, grads = _fkl_chunk(h, ht[i:i + step], keep[i:i + step], student_head, teacher_head,
                                         temperature, w_div, want, params)
                if want:
                    grad_h[i:i + step] = grads[0]
                    for acc, g in zip(grad_p, grads[1:]):
                        if g is not None:
                            acc += g
                total, div, top1 = total + w_div * d, div + d, top1 + t
                continue
            with torch.enable_grad():
                h = hs[i:i + step].detach().requires_grad_(want)
                d, c, t = _chunk_terms(h, ht[i:i + step], keep[i:i + step], student_head, teacher_head, kind,
                                       temperature, beta, lab)
                loss = w_div * d + w_ce * c
                if want:
                    grads = torch.autograd.grad(loss, [h, *params], allow_unused=True)
                    grad_h[i:i + step] = grads[0]
                    for acc, g in zip(grad_p, grads[1:]):
                        if g is not None:
                            acc += g
            total, div, ce, top1 = total + loss.detach(), div + d.detach(), ce + c.detach(), top1 + t
        ctx.save_for_backward(*([grad_h, *grad_p] if want else []))
        ctx.mark_non_differentiable(div, ce, top1)
        return total, div, ce, top1

    @staticmethod
    def backward(ctx, g_total, g_div, g_ce, g_top1):
        saved = ctx.saved_tensors
        if not saved:
            return (None,) * len(ctx.needs_input_grad)
        grad_h, *grad_p = saved
        return (grad_h * g_total, None, None, None, None, *[g * g_total for g in grad_p])


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


def hidden_mse_sum(student_states: list[torch.Tensor], teacher_states: list[torch.Tensor],
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over layers and real tokens of the per-token mean squared error over hidden units (fp32)."""
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
    return total
