"""Split LoRA on packed experts (``method.lora.experts=split``, the default): the conventional mixture runs the
base weights and each adapter as two rank-r grouped matmuls on the routed rows (x A B), never materialising the
[E, m, n] delta B A or its gradient. Oracle: the same model with ``experts=merged`` (the weights W + scale B A,
HF's experts module on them), same adapters (B made non-zero so the adapters matter).

Tolerance from the arithmetic: split computes x W^T + s (x A^T) B^T where merged computes x (W + s B A)^T: the
same sums grouped differently, so each output differs by float32 rounding of O(n) terms, a few ulp of its
magnitude (relative 1e-5 on O(1) values through two layers and a loss; observed <= 2e-6); the router, attention
and every adapter gradient likewise.
"""

from __future__ import annotations

import pytest
import torch

import moe_lab
from moe_lab.moe.block import splits_lora
from tests.conftest import ROOT, build_tiny, random_batch

LORA = {"rank": 4, "alpha": 8, "targets": ["experts", "attention"]}


def _adapted(family: str, experts: str, method: str = "sft", rank: int = 4):
    model = build_tiny(family).train()
    patch = moe_lab.apply(model, method, lora={**LORA, "rank": rank, "experts": experts})
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model, patch


def _step(model, batch):
    torch.manual_seed(7)
    out = model(**batch)
    out.loss.backward()
    return out


@pytest.mark.parametrize("family,rank", [("olmoe", 4), ("olmoe", 2), ("qwen2_moe", 4), ("gpt_oss", 4),
                                         ("aria_text", 4), ("deepseek_v3", 4)])
@pytest.mark.parametrize("method", ["sft", "densemixer"])
def test_split_equals_merged(family, rank, method):
    """Rank 2 in fp32 (8-byte rows) takes transformers' per-expert fallback for the rank steps."""
    merged, _ = _adapted(family, "merged", method, rank)
    split, patch = _adapted(family, "split", method, rank)
    assert all(block.split_lora and splits_lora(view) for view, block in zip(patch.views, patch.layers))
    batch = random_batch()
    want, got = _step(merged, batch), _step(split, batch)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    grads = dict(merged.named_parameters())
    for name, p in split.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    assert any("lora_A" in n and p.grad.abs().sum() > 0 for n, p in split.named_parameters() if p.requires_grad)


def test_split_never_materialises_the_merged_weights(monkeypatch):
    """The parametrized expert tensors (W + scale B A) are never computed in a split step, forward or backward
    (DenseMixer's inactive-expert pass included); the merged step computes them."""
    from moe_lab.methods.lora import PackedLoRA

    calls = []
    monkeypatch.setattr(PackedLoRA, "delta", lambda self: calls.append(1) or self.scale * self.lora_B @ self.lora_A)
    split, _ = _adapted("olmoe", "split", "densemixer")
    _step(split, random_batch())
    assert calls == []
    merged, _ = _adapted("olmoe", "merged", "densemixer")
    _step(merged, random_batch())
    assert calls


def test_layouts_that_cannot_split_use_the_merged_weights():
    """DBRX's row blocks and Llama 4's weight-scaled inputs run the merged weights (the same result as before)."""
    for family in ("dbrx", "llama4_text"):
        model, patch = _adapted(family, "split")
        assert not any(splits_lora(view) for view in patch.views)
        assert torch.isfinite(_step(model, random_batch()).loss)


def test_bad_setting_is_refused():
    with pytest.raises(ValueError, match="method.lora.experts=fused: choose split"):
        moe_lab.apply(build_tiny("olmoe"), "sft", lora={**LORA, "experts": "fused"})


@pytest.mark.slow
def test_bench_flow_at_tiny_width(capsys):
    """bench/lora_experts.py end to end at a tiny width (its numbers are for docs/results.md, not asserted): both
    variants run in their own processes and the ratios line is printed."""
    import runpy

    bench = runpy.run_path(str(ROOT / "bench" / "lora_experts.py"))
    bench["main"](["--hidden", "64", "--intermediate", "32", "--experts", "8", "--top-k", "2", "--tokens", "16",
                   "--rank", "4", "--warmup", "0", "--steps", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert "merged" in out and "split" in out and "split / merged: step time" in out
