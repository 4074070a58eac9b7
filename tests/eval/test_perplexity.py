"""Sliding-window perplexity against HF's own loss: one window, and a hand-rolled sliding window."""

from __future__ import annotations

import math

import pytest
import torch

import moe_lab
from moe_lab.data.tokenizer import build_byte_tokenizer
from moe_lab.eval.perplexity import perplexity, sliding_windows
from tests.conftest import build_tiny

TEXT = "The tower is 324 metres tall, about the same height as an 81-storey building.\n" * 2


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def hand_rolled(model, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """The HF guide's loop (labels -100 on the overlap, HF's shifted mean loss), weighting each window's
    loss by the number of labels the shift actually scores."""
    input_ids = torch.tensor([ids])
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        trg_len = end - prev_end
        window = input_ids[:, begin:end]
        labels = window.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids=window, labels=labels).loss.item()
        scored = int((labels[:, 1:] != -100).sum())
        nll_sum += loss * scored
        n_tokens += scored
        prev_end = end
        if end == len(ids):
            break
    return nll_sum / n_tokens, n_tokens


@pytest.mark.parametrize("fam", ["olmoe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("patched", [False, True], ids=["vanilla", "moe_lab"])
def test_single_window_is_exp_of_mean_token_loss(fam, patched, tok):
    model = build_tiny(fam).eval()
    ids = tok(TEXT)["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    if patched:
        moe_lab.apply(model)
    out = perplexity(model, tok, TEXT, max_length=512, stride=512)
    assert out["tokens"] == len(ids) - 1
    assert out["nll"] == pytest.approx(loss, rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp(loss), rel=1e-5)


@pytest.mark.parametrize("fam", ["olmoe", "gpt_oss"])
@pytest.mark.parametrize("max_length, stride", [(64, 16), (48, 48), (50, 7)])
def test_sliding_window_matches_hand_rolled_loop(fam, max_length, stride, tok):
    model = build_tiny(fam).eval()
    ids = tok(TEXT)["input_ids"]
    nll, n_tokens = hand_rolled(model, ids, max_length, stride)
    for batch_size in (1, 8):
        out = perplexity(model, tok, ids, max_length=max_length, stride=stride, batch_size=batch_size)
        assert out["tokens"] == n_tokens
        assert out["nll"] == pytest.approx(nll, rel=1e-5)
    assert perplexity(model, tok, torch.tensor(ids), max_length, stride)["nll"] == pytest.approx(nll, rel=1e-5)


def test_sliding_windows_score_each_token_once():
    assert sliding_windows(10, 4, 2) == [(0, 1, 4), (2, 4, 6), (4, 6, 8), (6, 8, 10)]
    assert sliding_windows(10, 4, 4) == [(0, 1, 4), (4, 5, 8), (8, 9, 10)]  # window starts have no context
    assert sliding_windows(3, 8, 8) == [(0, 1, 3)]
    for n, length, stride in [(100, 16, 5), (37, 37, 1), (2, 2, 2), (40, 8, 8)]:
        windows = sliding_windows(n, length, stride)
        scored = [t for _, first, end in windows for t in range(first, end)]
        unscored = {0} | ({begin for begin, _, _ in windows} if stride == length else set())
        assert scored == sorted(set(range(n)) - unscored)
        assert all(end - begin <= length for begin, _, end in windows)


@pytest.mark.parametrize(
    "n, max_length, stride, match",
    [(10, 1, 1, "max_length must be >= 2"), (10, 4, 5, "stride must be in"), (10, 4, 0, "stride must be in"),
     (1, 4, 2, "at least 2 tokens")],
)
def test_bad_windows_are_named(n, max_length, stride, match):
    with pytest.raises(ValueError, match=match):
        sliding_windows(n, max_length, stride)
