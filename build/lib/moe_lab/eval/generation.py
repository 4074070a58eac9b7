"""Batched generation with a KV cache: left padding, greedy or temperature/top-p sampling, stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moe_lab.data.collate import encode_prompt
from moe_lab.eval.likelihood import eval_mode, forward, model_device

# A stop string is looked for in the decoded last (its UTF-8 length + this many) tokens before the full
# text is decoded to confirm it; every token of a byte-level or byte-fallback tokenizer is >= 1 byte.
_STOP_WINDOW_MARGIN = 8
_REPLACEMENT = "\ufffd"


def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int = 256,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    num_samples: int = 1,
    batch_size: int = 16,
    stop: list[str] | None = None,
    seed: int = 0,
) -> list[list[str]]:
    """``num_samples`` completions per prompt: the decoded new text, cut before the first stop string.

    Prompts are tokenized with ``encode_prompt`` (the ids training used), sorted by length and left-padded
    into batches of ``batch_size`` sequences (each sample is one sequence); position ids count real tokens
    only, so a prompt's completion does not depend on its batch. A sequence ends at an eos token (the
    tokenizer's or the generation config's), at a stop string, or after ``max_new_tokens``; finished
    sequences leave the batch and its KV cache. Greedy decoding takes the first argmax; sampling draws
    from softmax(logits / temperature) restricted to the top-p nucleus, sample ``j`` of prompt ``i`` with
    its own generator seeded from ``(seed, i, j)``, so results do not depend on ``batch_size`` either.
    Ids the tokenizer cannot decode (a vocabulary padded past ``len(tokenizer)``) are never generated.
    Greedy decoding computes one completion and repeats it ``num_samples`` times.
    """
    _check_args(prompts, max_new_tokens, temperature, top_p, num_samples, batch_size, stop)
    stops = list(stop or [])
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i} is empty and the tokenizer has no bos token to start from")
    n_runs = num_samples if do_sample else 1
    rows = [(i, j) for i in range(len(prompts)) for j in range(n_runs)]
    rows.sort(key=lambda row: -len(encoded[row[0]]))
    decoder = _Decoder(tokenizer, stops)
    texts: dict[tuple[int, int], str] = {}
    with eval_mode(model):
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            sampler = _Sampler(do_sample, temperature, top_p, [_row_seed(seed, i, j) for i, j in chunk],
                               model_device(model))
            new_ids = generate_ids(model, [encoded[i] for i, _ in chunk], max_new_tokens=max_new_tokens,
                                   sampler=sampler, eos_ids=eos_token_ids(model, tokenizer),
                                   pad_id=_pad_id(tokenizer), vocab_limit=len(tokenizer),
                                   is_finished=decoder.hits_stop if stops else None)
            for row, ids in zip(chunk, new_ids):
                texts[row] = decoder.final_text(ids)
    return [[texts[(i, j if do_sample else 0)] for j in range(num_samples)] for i in range(len(prompts))]


def pass_at_1(correct: list[list[bool]]) -> float:
    """Mean over prompts of the fraction of correct samples (pass@1 estimated from n samples per prompt)."""
    if not correct:
        raise ValueError("pass_at_1 needs at least one prompt")
    for i, samples in enumerate(correct):
        if not samples:
            raise ValueError(f"prompt {i} has no samples; pass@1 is undefined for it")
    return sum(sum(map(bool, samples)) / len(samples) for samples in correct) / len(correct)


def generate_ids(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampler: _Sampler,
    eos_ids: set[int],
    pad_id: int,
    vocab_limit: int | None = None,
    is_finished=None,
) -> list[list[int]]:
    """New token ids (eos excluded) for each left-padded prompt, decoded with the model's KV cache.

    ``is_finished(ids) -> bool`` is asked after each new token of a sequence (e.g. a stop string check).
    Call under ``eval_mode``.
    """
    device = model_device(model)
    width = max(len(ids) for ids in prompt_ids)
    batch = len(prompt_ids)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for r, ids in enumerate(prompt_ids):
        input_ids[r, width - len(ids):] = torch.tensor(list(ids))
        attention_mask[r, width - len(ids):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = _forward(model, input_ids, attention_mask, position_ids, cache=None)
    cache, next_position = out.past_key_values, position_ids[:, -1] + 1
    active = list(range(batch))  # original row of each row still in the batch
    generated: list[list[int]] = [[] for _ in range(batch)]
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        tokens = sampler(logits, active).tolist()
        keep = []
        for pos, (row, token) in enumerate(zip(active, tokens)):
            if token in eos_ids:
                continue
            generated[row].append(token)
            if is_finished is None or not is_finished(generated[row]):
                keep.append(pos)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            attention_mask, next_position = attention_mask[index], next_position[index]
            tokens = [tokens[p] for p in keep]
            active = [active[p] for p in keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
        step_ids = torch.tensor(tokens, device=device)[:, None]
        out = _forward(model, step_ids, attention_mask, next_position[:, None], cache=cache)
        next_position = next_position + 1
    return generated


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """The tokenizer's eos id together with every eos id of the model's generation config."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    return ids


class _Sampler:
    """Next token per row: argmax, or a draw from the tempered top-p distribution with a per-row generator."""

    def __init__(self, do_sample: bool, temperature: float, top_p: float, seeds: list[int], device):
        self.do_sample, self.temperature, self.top_p = do_sample, temperature, top_p
        self.generators = []
        if do_sample:
            self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if not self.do_sample:
            return logits.argmax(-1)
        probs = top_p_filter(torch.softmax(logits / self.temperature, dim=-1), self.top_p)
        draws = [torch.multinomial(probs[k], 1, generator=self.generators[row]) for k, row in enumerate(rows)]
        return torch.cat(draws)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Renormalised probabilities on the nucleus: the most likely tokens, in order, until their mass reaches
    ``top_p`` (the token that crosses it included; the most likely token is always kept)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    sorted_probs[..., 0] = probs.gather(-1, order[..., :1]).squeeze(-1)
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


class _Decoder:
    """Decodes generated ids and finds stop strings in them."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.window = max((len(s.encode("utf-8")) for s in stops), default=0) + _STOP_WINDOW_MARGIN

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def hits_stop(self, ids: list[int]) -> bool:
        """Whether the text so far holds a stop string. Trailing U+FFFD (the bytes of a character still being
        generated, for byte-level tokenizers) is ignored: the finished character may differ."""
        tail = self.text(ids[-self.window:]).rstrip(_REPLACEMENT)
        if not any(s in tail for s in self.stops):
            return False
        full = self.text(ids).rstrip(_REPLACEMENT) if len(ids) > self.window else tail
        return any(s in full for s in self.stops)

    def final_text(self, ids: list[int]) -> str:
        text = self.text(ids)
        cut = min((text.find(s) for s in self.stops if s in text), default=len(text))
        return text[:cut]


def _forward(model, input_ids, attention_mask, position_ids, cache):
    """One cached step; logits only for the last position."""
    return forward(model, input_ids, attention_mask, keep=1, position_ids=position_ids,
                   past_key_values=cache, use_cache=True)


def _row_seed(seed: int, prompt: int, sample: int) -> int:
    return ((seed * 1_000_003 + prompt) * 10_007 + sample) & (2**63 - 1)


def _pad_id(tokenizer: Any) -> int:
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def _check_args(prompts, max_new_tokens, temperature, top_p, num_samples, batch_size, stop) -> None:
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be a list of strings")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use do_sample=False for greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if stop is not None and (isinstance(stop, str) or any(not isinstance(s, str) or not s for s in stop)):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
