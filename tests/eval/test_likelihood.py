"""Multiple-choice log-likelihoods against a direct per-choice computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_lab
from moe_lab.data.tokenizer import build_byte_tokenizer
from moe_lab.eval.likelihood import encode_pair, score_choices
from tests.conftest import build_tiny

CONTEXTS = [
    "Question: is water wet?\nAnswer:",
    "The capital of France is ",  # trailing space moves to the continuation
    "2+2=",
]
CHOICES = [[" true", " false"], ["Paris", "Rome", "a very long answer"], [" 4", " 5", " 22", " four"]]


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def direct_loglik(model, tok, context: str, choice: str) -> float:
    """One forward on bos + context + choice (no padding); sum of log-softmax at the choice's bytes."""
    ctx = context.rstrip(" ")
    cont = context[len(ctx):] + choice
    ctx_ids = [tok.bos_token_id] + [b + 3 for b in ctx.encode("utf-8")]
    cont_ids = [b + 3 for b in cont.encode("utf-8")]
    ids = torch.tensor([ctx_ids + cont_ids])
    with torch.no_grad():
        logprobs = F.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    n = len(ctx_ids)
    return sum(logprobs[n - 1 + k, t].item() for k, t in enumerate(cont_ids))


@pytest.mark.parametrize("fam", ["olmoe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("patched", [False, True], ids=["vanilla", "moe_lab"])
def test_logliks_equal_direct_computation(fam, patched, tok):
    model = build_tiny(fam).eval()
    expected = [[direct_loglik(model, tok, c, o) for o in opts] for c, opts in zip(CONTEXTS, CHOICES)]
    if patched:
        moe_lab.apply(model)
    for batch_size in (1, 4, 16):
        out = score_choices(model, tok, CONTEXTS, CHOICES, batch_size=batch_size)
        for res, exp in zip(out, expected):
            assert res["loglik"] == pytest.approx(exp, rel=1e-5, abs=1e-4)
            assert res["pred"] == max(range(len(exp)), key=exp.__getitem__)


def test_encode_pair_follows_lm_eval(tok):
    ctx, cont = encode_pair(tok, "The capital is  ", "Paris")
    assert ctx == [1] + [b + 3 for b in b"The capital is"]
    assert cont == [b + 3 for b in b"  Paris"]


def test_acc_norm_divides_by_characters_and_acc_bytes_by_bytes(tok, monkeypatch):
    """Fixed log-likelihoods on choices whose lengths differ in characters and bytes ("éé": 2 characters,
    4 bytes; "abc": 3 and 3), so the three rules pick different choices."""
    from moe_lab.eval import likelihood

    monkeypatch.setattr(likelihood, "continuation_logliks", lambda model, pairs, **kw: [-2.5, -3.0, -3.5, -3.0])
    first, second = likelihood.score_choices(object(), tok, ["x", "y"], [["éé", "abc"], ["éé", "abc"]])
    assert first == {"loglik": [-2.5, -3.0], "pred": 0, "pred_norm": 1, "pred_bytes": 0}  # -1.25<-1; -.625>-1
    assert second == {"loglik": [-3.5, -3.0], "pred": 1, "pred_norm": 1, "pred_bytes": 0}  # -.875 > -1


def test_bad_input_is_named(tok):
    model = build_tiny("olmoe")
    with pytest.raises(ValueError, match="2 contexts but 1 choice lists"):
        score_choices(model, tok, ["a", "b"], [["x"]])
    with pytest.raises(ValueError, match="item 1: the choice list is empty"):
        score_choices(model, tok, ["a", "b"], [["x"], []])
    with pytest.raises(ValueError, match="item 0: choice 1 is an empty string"):
        score_choices(model, tok, ["a"], [["x", ""]])
