"""The written-out forward-KL gradient of ``chunked_head_kd`` (tau (p_S - p_T)) equals autograd's."""

from __future__ import annotations

import math

import pytest
import torch

from moe_lab.distill import chunked_head_kd

EPS = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("tau, chunk, masked", [(1.0, 5, False), (2.0, 4, True), (0.5, None, True)])
def test_analytic_equals_autograd(tau, chunk, masked):
    torch.manual_seed(0)
    n, hidden, vocab = 13, 16, 97
    h_t = torch.randn(n, hidden)
    head_s, head_t = torch.nn.Linear(hidden, vocab), torch.nn.Linear(hidden, vocab).requires_grad_(False)
    mask = (torch.arange(n) % 4 != 1) if masked else None
    out = {}
    for analytic in (True, False):
        h_s = torch.randn(n, hidden, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        head_s.zero_grad()
        loss, div, _, top1 = chunked_head_kd(h_s, h_t, head_s, head_t, temperature=tau, mask=mask,
                                             chunk_size=chunk, kd_weight=0.7, analytic_grad=analytic)
        (3.0 * loss).backward()
        out[analytic] = (loss.detach(), div, top1, h_s.grad.clone(), head_s.weight.grad.clone(),
                         head_s.bias.grad.clone())
    a, b = out[True], out[False]
    assert torch.equal(a[2], b[2])
    # loss: the same fp32 terms (p_T (log p_T - log p_S)) summed in another order: eps x V x rows x value
    assert abs(float(a[1] - b[1])) <= EPS * vocab * n * max(1.0, float(b[1]))
    assert torch.allclose(a[0], 0.7 * a[1])
    # dL/dz per logit: |tau (p_S - p_T)| <= tau, each path a few ulps of p apart (softmax, exp): 8 eps tau per
    # logit; through the head a sum over V (h) or over N rows (weights) of such terms times |W| or |h|
    dz = 8 * EPS * tau * 3.0 * 0.7
    w, h = head_s.weight.abs().max().item(), h_s.abs().max().item()
    assert (a[3] - b[3]).abs().max() <= dz * vocab * w
    assert (a[4] - b[4]).abs().max() <= dz * n * max(h, 1.0)
    assert (a[5] - b[5]).abs().max() <= dz * n
    assert a[3].abs().max() > 1e3 * dz * vocab * w / math.sqrt(vocab)  # gradients far above the tolerance
    if masked:
        assert a[3][~mask].abs().max() == 0  # no gradient into padding


def test_labels_and_other_kinds_keep_autograd():
    torch.manual_seed(0)
    h_s, h_t = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8)
    head_s, head_t = torch.nn.Linear(8, 11), torch.nn.Linear(8, 11).requires_grad_(False)
    labels = torch.tensor([1, 2, -100, 4, 5, 6])
    for kwargs in ({"labels": labels, "ce_weight": 0.5}, {"kind": "reverse_kl"}):
        runs = [chunked_head_kd(h_s, h_t, head_s, head_t, chunk_size=4, analytic_grad=flag, **kwargs)[0]
                for flag in (True, False)]
        assert torch.equal(*[torch.autograd.grad(r, h_s)[0] for r in runs])
