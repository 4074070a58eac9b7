"""Log-likelihood of continuations (multiple-choice scoring with lm-eval's conventions)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from moe_lab.data.collate import encode_prompt


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` in eval mode without autograd; its previous train/eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def model_device(model: torch.nn.Module) -> torch.device:
    """Device of the model's first parameter (where inputs go)."""
    return next(model.parameters()).device


def max_model_length(model: torch.nn.Module) -> int | None:
    """``config.max_position_embeddings`` when the model has one (longer inputs are left-truncated)."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def forward(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, keep: int = 0, **kwargs
):
    """The model's output; with ``keep > 0`` only the last ``keep`` positions have logits (through
    ``logits_to_keep`` when the model's forward takes it, so the others are never computed)."""
    if keep and _takes_logits_to_keep(type(model)):
        kwargs["logits_to_keep"] = keep
    out = model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    if keep and out.logits.shape[1] > keep:
        out.logits = out.logits[:, -keep:]
    return out


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation token ids, as lm-eval's ``_encode_pair`` does for causal models.

    Trailing whitespace of the context moves to the continuation; ``context + continuation`` is tokenized
    as a whole (with ``encode_prompt``, so bos comes first as in training) and split after as many tokens
    as the context alone has, so the continuation tokens are the ones the model would produce.
    """
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    context_ids = encode_prompt(tokenizer, context)
    whole_ids = encode_prompt(tokenizer, context + continuation)
    return context_ids, whole_ids[len(context_ids):]


def continuation_logliks(
    model: torch.nn.Module,
    pairs: Sequence[tuple[list[int], list[int]]],
    batch_size: int = 16,
    max_length: int | None = None,
) -> list[float]:
    """Sum of log p(continuation token | everything before it) for each ``(context_ids, continuation_ids)``.

    The model sees ``(context + continuation)[:-1]`` (left-truncated to ``max_length`` tokens) and the last
    ``len(continuation)`` positions are scored. Pairs are sorted by length and right-padded into batches
    (padding after a causal sequence cannot change it), so results do not depend on ``batch_size``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rows = []
    for i, (context_ids, continuation_ids) in enumerate(pairs):
        if not continuation_ids:
            raise ValueError(f"pair {i}: the continuation has no tokens; nothing to score")
        if not context_ids:
            raise ValueError(f"pair {i}: the context has no tokens (and the tokenizer no bos); the first "
                             "continuation token cannot be scored")
        if max_length is not None and len(continuation_ids) > max_length:
            raise ValueError(
                f"pair {i}: the continuation has {len(continuation_ids)} tokens, more than max_length="
                f"{max_length}; it cannot be scored in one window"
            )
        ids = (list(context_ids) + list(continuation_ids))[:-1]
        if max_length is not None:
            ids = ids[-max_length:]
        rows.append((ids, list(continuation_ids)))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    device = model_device(model)
    out = [0.0] * len(rows)
    with eval_mode(model):
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            width = max(len(rows[i][0]) for i in chunk)
            input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, i in enumerate(chunk):
                ids = rows[i][0]
                input_ids[r, :len(ids)] = torch.tensor(ids)
                attention_mask[r, :len(ids)] = 1
            # Only the scored positions need vocabulary logits: keep the last `keep` of the padded width.
            keep = max(width - (len(rows[i][0]) - len(rows[i][1])) for i in chunk)
            logits = forward(model, input_ids.to(device), attention_mask.to(device), keep).logits
            shift = width - logits.shape[1]
            for r, i in enumerate(chunk):
                ids, target = rows[i]
                scored = logits[r, len(ids) - len(target) - shift:len(ids) - shift].float()
                logprobs = F.log_softmax(scored, dim=-1)
                target_t = torch.tensor(target, device=logprobs.device)
                out[i] = logprobs.gather(-1, target_t[:, None]).sum().item()
    return out


def score_choices(
    model: torch.nn.Module,
    tokenizer: Any,
    contexts: list[str],
    choices: list[list[str]],
    batch_size: int = 16,
    max_length: int | None = None,
) -> list[dict]:
    """Score each context's choices by continuation log-likelihood (lm-eval's multiple-choice convention).

    Returns one dict per context: ``loglik`` (one float per choice), ``pred`` (argmax loglik, lm-eval
    ``acc``), ``pred_norm`` (argmax of loglik / number of characters of the choice, lm-eval ``acc_norm``)
    and ``pred_bytes`` (argmax of loglik / number of UTF-8 bytes, lm-eval ``acc_bytes``). Ties go to the
    first choice. Choices are scored as given: add the separator (usually a leading space) yourself.
    ``max_length`` defaults to the model's ``max_position_embeddings``.
    """
    if len(contexts) != len(choices):
        raise ValueError(f"{len(contexts)} contexts but {len(choices)} choice lists; they must pair up")
    pairs = []
    for i, (context, options) in enumerate(zip(contexts, choices)):
        if not options:
            raise ValueError(f"item {i}: the choice list is empty")
        for j, option in enumerate(options):
            if not option:
                raise ValueError(f"item {i}: choice {j} is an empty string; nothing to score")
            pairs.append(encode_pair(tokenizer, context, option))
    if max_length is None:
        max_length = max_model_length(model)
    logliks = continuation_logliks(model, pairs, batch_size=batch_size, max_length=max_length)
    results, k = [], 0
    for options in choices:
        ll = logliks[k:k + len(options)]
        k += len(options)
        by_chars = [v / len(o) for v, o in zip(ll, options)]
        by_bytes = [v / len(o.encode("utf-8")) for v, o in zip(ll, options)]
        results.append({"loglik": ll, "pred": _argmax(ll), "pred_norm": _argmax(by_chars),
                        "pred_bytes": _argmax(by_bytes)})
    return results


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))
