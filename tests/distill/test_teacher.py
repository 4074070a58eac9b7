"""Widened teacher routing (spec 2.9 / 2.15 item 17): k' = k reproduces the teacher; k' = E with the family's
renormalisation equals the full-softmax mixture; k' > E is refused."""

from __future__ import annotations

import pytest
import torch

from moe_lab.distill import widen_teacher
from tests.conftest import build_tiny, random_batch


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss", "olmoe", "phimoe"])
def test_k_prime_equal_k_is_the_teacher(family):
    model = build_tiny(family).eval()
    batch = random_batch()
    with torch.no_grad():
        ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        k = model.config.num_experts_per_tok
        patch = widen_teacher(model, k)
        got = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(got, ref)
    patch.remove()


def test_k_prime_widens_and_full_set_is_softmax_mixture():
    model = build_tiny("qwen3_moe").eval()
    batch = {k: random_batch()[k] for k in ("input_ids", "attention_mask")}
    E = model.config.num_experts
    with torch.no_grad():
        base = model(**batch).logits
        patch = widen_teacher(model, 4)
        wide = model(**batch).logits
        patch.remove()
        patch = widen_teacher(model, E)  # family rule: renormalise over all E = the softmax itself
        family = model(**batch).logits
        patch.remove()
        patch = widen_teacher(model, E, weight_rule="raw")  # raw softmax p of every expert
        raw = model(**batch).logits
        patch.remove()
    assert not torch.allclose(wide, base, atol=1e-4)
    # the two differ only by dividing by sum(p) = 1 +- E ulp
    assert torch.allclose(family, raw, rtol=0, atol=1e-5)


def test_raw_rule_differs_for_a_renormalising_family_and_k_prime_checked():
    model = build_tiny("qwen3_moe").eval()
    batch = {k: random_batch()[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        patch = widen_teacher(model, 2)
        fam = model(**batch).logits
        patch.remove()
        patch = widen_teacher(model, 2, weight_rule="raw")
        raw = model(**batch).logits
        patch.remove()
    assert not torch.allclose(fam, raw, atol=1e-4)
    with pytest.raises(ValueError, match=r"teacher_top_k=9: layer 1 has 8 experts; choose 1 <= k' <= 8"):
        widen_teacher(model, 9)
    with pytest.raises(ValueError, match="teacher_weight_rule='p'"):
        widen_teacher(model, 2, weight_rule="p")
