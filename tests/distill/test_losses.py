"""KD loss oracles (docs/specs/compression.md 2.15 item 17): float64 references with log-softmax written out."""

from __future__ import annotations

import pytest
import torch

from moe_lab.distill import chunked_head_kd, hidden_mse_sum, kd_loss, token_divergence


def _log_softmax64(x):
    x = x.double()
    shifted = x - x.max(dim=-1, keepdim=True).values
    return shifted - shifted.exp().sum(-1, keepdim=True).log()


def _kl64(log_p, log_q):  # KL(p || q) per row
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _logits(seed, n=6, v=11, scale=3.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def test_hand_computed_two_token_kl():
    s = torch.tensor([[0.0, 0.0]])
    t = torch.tensor([[0.0, torch.log(torch.tensor(3.0))]])  # p_T = (1/4, 3/4), p_S = (1/2, 1/2)
    expected = 0.25 * torch.log(torch.tensor(0.5)) + 0.75 * torch.log(torch.tensor(1.5))
    assert torch.allclose(kd_loss(s, t), expected, atol=1e-7)
    rev = 0.5 * torch.log(torch.tensor(2.0)) + 0.5 * torch.log(torch.tensor(2.0 / 3.0))
    assert torch.allclose(kd_loss(s, t, kind="reverse_kl"), rev, atol=1e-7)


@pytest.mark.parametrize("tau", [1.0, 2.0, 0.5])
def test_forward_reverse_jsd_match_float64(tau):
    s, t = _logits(0), _logits(1)
    ls, lt = _log_softmax64(s / tau), _log_softmax64(t / tau)
    fkl = _kl64(lt, ls).mean() * tau**2
    rkl = _kl64(ls, lt).mean() * tau**2
    beta = 0.3
    lm = (beta * lt.exp() + (1 - beta) * ls.exp()).log()
    jsd = (beta * _kl64(lt, lm) + (1 - beta) * _kl64(ls, lm)).mean() * tau**2
    # fp32 log-softmax over V=11 logits of magnitude ~10: errors ~ 1e-6 relative
    for kind, ref in (("forward_kl", fkl), ("reverse_kl", rkl), ("jsd", jsd)):
        got = kd_loss(s, t, kind=kind, temperature=tau, beta=beta)
        assert got.dtype == torch.float32
        assert abs(float(got) - float(ref)) <= 2e-6 * max(1.0, float(ref)), kind
    assert float(fkl) >= 0 and abs(float(fkl) - float(rkl)) > 1e-2  # asymmetric inputs: fKL != rKL


def test_zero_on_identical_and_tau_squared():
    s = _logits(3)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        assert float(kd_loss(s, s.clone(), kind=kind)) == pytest.approx(0.0, abs=1e-6)
    t = _logits(4)
    per = token_divergence(s, t, temperature=2.0)
    ref = _kl64(_log_softmax64(t / 2), _log_softmax64(s / 2)) * 4.0
    assert torch.allclose(per.double(), ref, rtol=2e-6, atol=1e-6)


def test_mask_and_normalizer():
    s, t = _logits(5, n=8), _logits(6, n=8)
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1])
    ref = _kl64(_log_softmax64(t), _log_softmax64(s))[mask.bool()].mean()
    assert torch.allclose(kd_loss(s, t, mask=mask).double(), ref, rtol=2e-6)
    # masked rows do not matter, even non-finite ones
    s2 = s.clone()
    s2[1] = float("nan")
    assert torch.allclose(kd_loss(s2, t, mask=mask), kd_loss(s, t, mask=mask))
    summed = kd_loss(s, t, mask=mask, normalizer=1.0)
    assert torch.allclose(summed.double(), ref * 5, rtol=2e-6)


def test_chunked_equals_unchunked_loss_and_gradient():
    torch.manual_seed(0)
    h_s = torch.randn(2, 7, 16, requires_grad=True)
    h_t = torch.randn(2, 7, 16)
    head_s, head_t = torch.nn.Linear(16, 50, bias=False), torch.nn.Linear(16, 50, bias=False)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    labels = torch.randint(0, 50, (2, 7))
    labels[0, -1] = -100
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        full = kd_loss(head_s(h_s), head_t(h_t), kind=kind, mask=mask, normalizer=1.0)
        ce_ref = torch.nn.functional.cross_entropy(head_s(h_s).reshape(-1, 50), labels.reshape(-1), reduction="sum")
        g_full = torch.autograd.grad(full + ce_ref, [h_s, head_s.weight], retain_graph=True)
        for chunk in (1, 3, 5, None):
            loss, div, ce, top1 = chunked_head_kd(h_s, h_t, head_s, head_t, kind=kind, mask=mask,
                                                  chunk_size=chunk, labels=labels)
            assert torch.allclose(loss, div + ce)
            g = torch.autograd.grad(loss, [h_s, head_s.weight])
            # sums of <= 14 fp32 terms of size ~10: reordering error ~ 14 * 1.2e-7 * 10
            assert torch.allclose(div, full, rtol=0, atol=2e-5) and torch.allclose(ce, ce_ref, atol=2e-5)
            for a, b in zip(g, g_full):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
            agree = (head_s(h_s).argmax(-1) == head_t(h_t).argmax(-1))[mask.bool()].sum()
            assert int(top1) == int(agree)
        # the weights of the two terms reach the gradient
        loss, div, ce, _ = chunked_head_kd(h_s, h_t, head_s, head_t, kind=kind, mask=mask, chunk_size=3,
                                           labels=labels, kd_weight=0.25, ce_weight=0.75)
        g = torch.autograd.grad(loss, h_s)[0]
        ref = torch.autograd.grad(0.25 * full + 0.75 * ce_ref, h_s)[0]
        assert torch.allclose(g, ref, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: no gradients computed, same values
        loss, div, _, _ = chunked_head_kd(h_s, h_t, head_s, head_t, mask=mask, chunk_size=3)
    assert not loss.requires_grad and torch.allclose(div, kd_loss(head_s(h_s), head_t(h_t), mask=mask,
                                                                 normalizer=1.0), atol=2e-5)


def test_chunked_analytic_plain_head_equals_full_logits():
    """Forward KL without labels (written-out gradient; bias-free Linear heads: head gradients by matmuls):
    chunk sizes 1, 3, 5 and unchunked against autograd through kd_loss on full logits."""
    torch.manual_seed(0)
    eps = torch.finfo(torch.float32).eps
    h_s, h_t = torch.randn(2, 7, 16, requires_grad=True), torch.randn(2, 7, 16)
    head_s, head_t = torch.nn.Linear(16, 50, bias=False), torch.nn.Linear(16, 50, bias=False)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    for tau in (1.0, 2.0):
        full = kd_loss(head_s(h_s), head_t(h_t), temperature=tau, mask=mask, normalizer=1.0)
        g_full = torch.autograd.grad(0.25 * full, [h_s, head_s.weight])
        agree = (head_s(h_s).argmax(-1) == head_t(h_t).argmax(-1))[mask.bool()].sum()
        for chunk in (1, 3, 5, None):
            loss, div, ce, top1 = chunked_head_kd(h_s, h_t, head_s, head_t, temperature=tau, mask=mask,
                                                  chunk_size=chunk, kd_weight=0.25)
            g = torch.autograd.grad(loss, [h_s, head_s.weight])
            # 10 rows of fp32 terms of size <= ~10 summed over 50 entries, in two different orders
            assert abs(float(div) - float(full)) <= 10 * 50 * eps * 10 * tau * tau and float(ce) == 0.0
            assert int(top1) == int(agree)
            # the logit gradient 0.25 tau (p_S - p_T): both paths within 8 eps of p per entry (sum over a row
            # <= 32 eps), then summed with |W| (h) or |h| (W) over 50 entries (h) or 10 rows (W) in fp32
            tol_h = 0.25 * tau * head_s.weight.abs().max() * (32 + 2 * 50) * eps
            tol_w = 0.25 * tau * h_s.abs().max() * 10 * (32 + 2 * 10) * eps
            assert (g[0] - g_full[0]).abs().max() <= tol_h and (g[1] - g_full[1]).abs().max() <= tol_w
            assert g[0][1, :3].abs().max() == 0  # padding gets no gradient


def test_bad_inputs_named():
    with pytest.raises(ValueError, match="student vocabulary 11 != teacher vocabulary 12"):
        kd_loss(_logits(0), _logits(1, v=12))
    with pytest.raises(ValueError, match="choose one of forward_kl"):
        kd_loss(_logits(0), _logits(1), kind="kl")
    with pytest.raises(ValueError, match="student hidden size 4 != teacher 5"):
        hidden_mse_sum([torch.zeros(2, 4)], [torch.zeros(2, 5)])
    with pytest.raises(ValueError, match="student has 1 decoder layers, teacher 2"):
        hidden_mse_sum([torch.zeros(2, 4)], [torch.zeros(2, 4)] * 2)


def test_hidden_mse_oracle():
    a = [torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    b = [torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    ref = sum(((x.double() - y.double()) ** 2).mean(-1)[mask.bool()].sum() for x, y in zip(a, b))
    assert torch.allclose(hidden_mse_sum(a, b, mask, layers="sum").double(), ref, rtol=1e-6)
    assert torch.allclose(hidden_mse_sum(a, b, mask).double(), ref / 2, rtol=1e-6)  # default: mean over 2 layers
    with pytest.raises(ValueError, match="layers='all': choose one of mean, sum"):
        hidden_mse_sum(a, b, mask, layers="all")
