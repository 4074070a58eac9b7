"""Perplexity with a sliding window and stride (the WikiText-2 convention of the HF perplexity guide)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from moe_lab.data.collate import encode_prompt
from moe_lab.eval.likelihood import continuation_logliks


def sliding_windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, first_scored, end)`` per window, as in the HF guide: windows ``[begin, end)`` start every
    ``stride`` tokens and hold at most ``max_length`` tokens; each scores only the tokens that the previous
    window did not reach (``[first_scored, end)``), with the rest of the window as context. A window's first
    token has no context in it and is never scored: with ``stride < max_length`` every token but token 0
    is scored exactly once; with ``stride == max_length`` (disjoint windows) each window's first is skipped.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (one context token and one scored token), got {max_length}")
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride must be in [1, max_length={max_length}] (a larger stride leaves tokens "
                         f"unscored), got {stride}")
    if n_tokens < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n_tokens}")
    windows, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        windows.append((begin, max(prev_end, begin + 1), end))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    text: str | Sequence[int] | torch.Tensor,
    max_length: int,
    stride: int,
    batch_size: int = 8,
) -> dict:
    """``{"ppl": exp(nll), "nll": mean negative log-likelihood per scored token (nats), "tokens": count}``.

    ``text`` is a string (tokenized with ``encode_prompt``: bos first, as in training) or pre-tokenized ids
    (used as given). Windows follow ``sliding_windows``; the mean is over all scored tokens, each weighted
    once. (The HF guide weights each window's mean loss by its number of labels minus one, which is exact
    for disjoint windows and one token short for overlapping windows after the first; this is the exact
    mean in both cases.)
    """
    if isinstance(text, str):
        ids = encode_prompt(tokenizer, text)
    else:
        ids = torch.as_tensor(text).flatten().tolist() if isinstance(text, torch.Tensor) else list(text)
    windows = sliding_windows(len(ids), max_length, stride)
    pairs = [(ids[begin:first], ids[first:end]) for begin, first, end in windows]
    logliks = continuation_logliks(model, pairs, batch_size=batch_size, max_length=max_length)
    n_scored = sum(end - first for _, first, end in windows)
    nll = -sum(logliks) / n_scored
    return {"ppl": math.exp(nll), "nll": nll, "tokens": n_scored}
