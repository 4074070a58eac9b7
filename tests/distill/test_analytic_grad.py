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


# --- student heads: plain Linear (gradients written out by matmuls), tied, bias, peft LoRA (autograd) ----------

N, HID, VOC = 13, 16, 97


class _Student(torch.nn.Module):
    """h_s = body(x), head(h_s): the parts of a causal LM that chunked_head_kd sees."""

    def __init__(self, head: str):
        super().__init__()
        self.kind = head
        self.head = torch.nn.Linear(HID, VOC, bias=head == "bias")
        if head == "tied":  # embedding and lm head share one Parameter, as with tie_word_embeddings
            self.emb = torch.nn.Embedding(VOC, HID)
            self.head.weight = self.emb.weight
        if head == "frozen":  # a plain head that is not trained (only the hidden states get gradients)
            self.head.requires_grad_(False)
        if head == "lora":
            import peft

            cfg = peft.LoraConfig(r=4, target_modules=["head"], init_lora_weights=False, lora_dropout=0.0)
            peft.inject_adapter_in_model(cfg, self)

    def inputs(self):
        g = torch.Generator().manual_seed(1)
        if self.kind == "tied":
            return torch.randint(0, VOC, (N,), generator=g)
        return torch.randn(N, HID, generator=g, dtype=self.head.weight.dtype).requires_grad_(True)

    def hidden(self, x):
        return self.emb(x) * 1.5 if self.kind == "tied" else x


def _float64_oracle(student, x, h_t, head_t, tau, keep, weight):
    """weight * tau^2 * sum over kept rows of KL(p_T || p_S) with log-softmax written out, its gradients by
    autograd in float64, and an elementwise bound on the fp32 error of each gradient.

    Bound: fp32 logits are dot products over <= HID + 8 terms (LoRA adds r), each off by <= dz = (HID + 8)
    eps |z|abs (|z|abs: the head evaluated on |weights| and |inputs|), which moves p by <= 2 p dz / tau; p is
    computed to 8 eps. So the logit gradient s (p_S - p_T) (s = weight tau) is off by
    E = s ((p_S + p_T)(2 dz / tau + 8 eps) + K eps |p_S - p_T|), K eps covering the fp32 accumulation of the
    backward matmuls (K = VOC + N + HID terms at most). The head is multilinear in its weights and input, so
    the error of every gradient is at most the backward of E through the head with all weights and inputs
    replaced by their absolute values."""
    import copy

    s64, t64 = copy.deepcopy(student).double(), copy.deepcopy(head_t).double()
    floating = x.is_floating_point()
    x64 = x.detach().double().requires_grad_(True) if floating else x
    with torch.no_grad():
        zt = t64(h_t.double())[keep] / tau
    zs = s64.head(s64.hidden(x64))[keep] / tau

    def log_softmax(z):
        z = z - z.max(-1, keepdim=True).values.detach()
        return z - z.exp().sum(-1, keepdim=True).log()

    lt, ls = log_softmax(zt), log_softmax(zs)
    loss = (lt.exp() * (lt - ls)).sum() * tau * tau
    params = [p for p in s64.parameters() if p.requires_grad]
    grads = torch.autograd.grad(weight * loss, params + ([x64] if floating else []))

    absm = copy.deepcopy(s64)
    with torch.no_grad():
        for prm in absm.parameters():
            prm.abs_()
        zt_abs = (h_t.double().abs() @ t64.weight.abs().t())[keep]
    x_abs = x64.detach().abs().requires_grad_(True) if floating else x
    z_abs = absm.head(absm.hidden(x_abs))[keep]
    dz = (HID + 8) * EPS * max(z_abs.max().item(), zt_abs.max().item())
    p_s, p_t = ls.exp().detach(), lt.exp()
    s = weight * tau
    err = s * ((p_s + p_t) * (2 * dz / tau + 8 * EPS) + (VOC + N + HID) * EPS * (p_s - p_t).abs())
    abs_params = [p for p in absm.parameters() if p.requires_grad]
    bounds = torch.autograd.grad(z_abs, abs_params + ([x_abs] if floating else []), grad_outputs=err)
    mag = max(zs.abs().max().item(), zt.abs().max().item()) + math.log(VOC)
    return loss.detach(), grads, bounds, dz, mag


@pytest.mark.parametrize("head, tau, chunk, masked", [
    ("plain", 1.0, 5, False), ("plain", 2.0, 4, True), ("plain", 0.5, None, True), ("tied", 1.0, 4, True),
    ("tied", 2.0, None, False), ("frozen", 2.0, 5, True), ("bias", 1.0, 5, True), ("lora", 1.0, 4, True),
    ("lora", 0.5, None, False)])
def test_heads_against_float64(head, tau, chunk, masked):
    """Both gradient paths (analytic: written out for plain / tied / frozen Linear heads, one autograd call per chunk
    for bias and peft LoRA heads; and autograd through the fp32 KL) against float64."""
    from moe_lab.distill.losses import _plain_head

    torch.manual_seed(0)
    student = _Student(head)
    head_t = torch.nn.Linear(HID, VOC, bias=False).requires_grad_(False)
    h_t = torch.randn(N, HID)
    keep = (torch.arange(N) % 4 != 1) if masked else torch.ones(N, dtype=torch.bool)
    x = student.inputs()
    assert _plain_head(student.head, student.hidden(x)) == (head in ("plain", "tied", "frozen"))
    weight = 0.7 * 3.0  # kd_weight x the gradient arriving at the loss (g_total != 1)
    loss64, grads64, bounds, dz, mag = _float64_oracle(student, x, h_t, head_t, tau, keep, weight)
    params = [p for p in student.parameters() if p.requires_grad]
    rows = int(keep.sum())
    for analytic in (True, False):
        for p in params:
            p.grad = None
        x = student.inputs()
        loss, div, _, _ = chunked_head_kd(student.hidden(x), h_t, student.head, head_t, temperature=tau, mask=keep,
                                          chunk_size=chunk, kd_weight=0.7, analytic_grad=analytic)
        (3.0 * loss).backward()
        # loss per kept row: logit errors dz / tau (both models) through |dKL/dz'| <= 2 each, plus fp32 terms of
        # size <= mag summed over the vocabulary; times tau^2
        assert abs(float(div) - float(loss64)) <= tau * tau * rows * (4 * dz / tau + (VOC + 16) * EPS * mag)
        got = [p.grad for p in params] + ([x.grad] if x.is_floating_point() else [])
        assert len(got) == len(grads64) == len(bounds)
        for g, ref, bound in zip(got, grads64, bounds):
            assert bool(((g.double() - ref).abs() <= bound).all()), (head, analytic)
            assert ref.abs().max() > 100 * bound.max()  # far above the tolerance
        if masked and x.is_floating_point():
            assert x.grad[~keep].abs().max() == 0


def test_plain_head_dispatch():
    from moe_lab.distill.losses import _plain_head

    h = torch.randn(3, HID)
    head = torch.nn.Linear(HID, VOC, bias=False)
    assert _plain_head(head, h)
    assert not _plain_head(torch.nn.Linear(HID, VOC), h)  # bias
    assert not _plain_head(head, h.double())  # dtype mismatch: F.linear raises its own error
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _plain_head(head, h)  # autocast casts the matmul: autograd keeps its casts
    handle = head.register_forward_hook(lambda m, a, out: out * 2)
    assert not _plain_head(head, h)  # a hook may change the output
    handle.remove()
    assert _plain_head(head, h)


def test_plain_head_hook_changes_result_through_autograd_path():
    """A forward hook on the head is honoured (autograd path), so the gradient is that of the hooked head."""
    torch.manual_seed(0)
    head_s = torch.nn.Linear(HID, VOC, bias=False)
    head_t = torch.nn.Linear(HID, VOC, bias=False).requires_grad_(False)
    h_s, h_t = torch.randn(N, HID, requires_grad=True), torch.randn(N, HID)
    plain = torch.autograd.grad(chunked_head_kd(h_s, h_t, head_s, head_t, chunk_size=5)[0], h_s)[0]
    head_s.register_forward_hook(lambda m, a, out: out * 2)
    hooked = torch.autograd.grad(chunked_head_kd(h_s, h_t, head_s, head_t, chunk_size=5)[0], h_s)[0]
    ref_head = torch.nn.Linear(HID, VOC, bias=False)
    ref_head.weight.data = head_s.weight.data * 2  # the hooked head is the plain head with weights doubled
    ref = torch.autograd.grad(chunked_head_kd(h_s, h_t, ref_head, head_t, chunk_size=5)[0], h_s)[0]
    assert not torch.allclose(plain, hooked)
    # the same logits up to one rounding (2 (hW) vs h (2W), exact in binary): identical gradients
    assert torch.equal(hooked, ref)


def test_gradients_accumulate_and_are_handed_over_once():
    torch.manual_seed(0)
    head_s = torch.nn.Linear(HID, VOC, bias=False)
    head_t = torch.nn.Linear(HID, VOC, bias=False).requires_grad_(False)
    h_s, h_t = torch.randn(N, HID, requires_grad=True), torch.randn(N, HID)
    mask = torch.arange(N) % 3 != 0
    chunked_head_kd(h_s, h_t, head_s, head_t, mask=mask, chunk_size=4)[0].backward()
    once = head_s.weight.grad.clone(), h_s.grad.clone()
    chunked_head_kd(h_s, h_t, head_s, head_t, mask=mask, chunk_size=4)[0].backward()
    assert torch.equal(head_s.weight.grad, 2 * once[0]) and torch.equal(h_s.grad, 2 * once[1])
    loss = chunked_head_kd(h_s, h_t, head_s, head_t, mask=mask, chunk_size=4)[0]
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="handed over once"):
        loss.backward()


def test_bf16_plain_head_close_to_float64():
    """bf16 head and hidden states: logits, G and the matmul outputs are each rounded once to bf16 (unit
    roundoff u = 2^-8, products accumulated in fp32), so the gradients are within a few u, normwise."""
    torch.manual_seed(0)
    head_s = torch.nn.Linear(HID, VOC, bias=False, dtype=torch.bfloat16)
    head_t = torch.nn.Linear(HID, VOC, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    h_s = torch.randn(N, HID, dtype=torch.bfloat16, requires_grad=True)
    h_t = torch.randn(N, HID, dtype=torch.bfloat16)
    loss, div, _, _ = chunked_head_kd(h_s, h_t, head_s, head_t, chunk_size=5)
    loss.backward()
    assert h_s.grad.dtype == torch.bfloat16 and head_s.weight.grad.dtype == torch.bfloat16
    hs64 = h_s.detach().double().requires_grad_(True)
    w64 = head_s.weight.detach().double().requires_grad_(True)
    lt = torch.log_softmax(h_t.double() @ head_t.weight.double().t(), -1)
    ls = torch.log_softmax(hs64 @ w64.t(), -1)
    ref = (lt.exp() * (lt - ls)).sum()
    ref_h, ref_w = torch.autograd.grad(ref, [hs64, w64])
    u = 2.0 ** -8
    # bf16 logits of size ~|z| <= 8 are off by u |z|; KL moves by <= 2 u |z| per row
    assert abs(float(div) - float(ref)) <= N * 2 * u * 8
    for got, want in ((h_s.grad, ref_h), (head_s.weight.grad, ref_w)):
        assert (got.double() - want).norm() <= 8 * u * want.norm()
