"""Batched generation against independent oracles: a no-cache argmax loop, HF generate, the model's own
distribution; invariance to batch size; stop strings, eos, samples, pass@1."""

from __future__ import annotations

import pytest
import torch

import moe_lab
from moe_lab.data.collate import encode_prompt
from moe_lab.data.tokenizer import build_byte_tokenizer
from moe_lab.eval.generation import generate, pass_at_1, top_p_filter
from tests.conftest import FAMILIES, build_tiny

# Different lengths (1 to 40 tokens with bos) so that batches need left padding; with 20 new tokens the
# gpt_oss sliding window (16) is crossed.
PROMPTS = [
    "Hello",
    "The answer is 4",
    "a",
    "Question: what is 2+2?\nAnswer:",
    "xyz " * 9,
    "",
    "Q",
    "Natalia sold clips to 48 friends.",
]
NEW = 20


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def naive_greedy_ids(model, tok, prompt: str, max_new_tokens: int) -> list[int]:
    """Full forward on the growing sequence (no cache, no padding), argmax over decodable ids, eos stops."""
    ids = encode_prompt(tok, prompt)
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids + new])).logits[0, -1]
            token = int(logits[: len(tok)].argmax())
            if token == tok.eos_token_id:
                break
            new.append(token)
    return new


def naive_greedy(model, tok, prompt: str, max_new_tokens: int) -> str:
    return tok.decode(naive_greedy_ids(model, tok, prompt, max_new_tokens), skip_special_tokens=True)


@pytest.mark.parametrize("fam", ["olmoe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("patched", [False, True], ids=["vanilla", "moe_lab"])
def test_greedy_equals_naive_no_cache_loop(fam, patched, tok):
    model = build_tiny(fam).eval()
    expected = [naive_greedy(model, tok, p, NEW) for p in PROMPTS]
    if patched:
        moe_lab.apply(model)
    got = generate(model, tok, PROMPTS, max_new_tokens=NEW, batch_size=16)
    assert got == [[e] for e in expected]
    assert any(len(e) > 0 for e in expected)


def test_greedy_equals_hf_generate_with_left_padding(tok):
    model = build_tiny("gpt_oss").eval()
    enc = [encode_prompt(tok, p) for p in PROMPTS]
    width = max(map(len, enc))
    input_ids = torch.tensor([[0] * (width - len(e)) + e for e in enc])
    attention_mask = (input_ids != 0).long()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW, do_sample=False,
                         suppress_tokens=list(range(len(tok), model.config.vocab_size)), pad_token_id=0)
    hf = [tok.decode(row[width:].tolist(), skip_special_tokens=True) for row in out]
    assert generate(model, tok, PROMPTS, max_new_tokens=NEW) == [[t] for t in hf]


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_is_deterministic_and_batch_size_invariant(fam, tok):
    model = build_tiny(fam)
    one = generate(model, tok, PROMPTS, max_new_tokens=NEW, batch_size=1)
    assert generate(model, tok, PROMPTS, max_new_tokens=NEW, batch_size=16) == one
    assert model.training  # the previous mode is restored
    # With stop strings rows leave the batch (and its KV cache) at different steps.
    stops = _stops_from([c[0] for c in one])
    assert generate(model, tok, PROMPTS, max_new_tokens=NEW, batch_size=16, stop=stops) == [
        [_cut(c[0], stops)] for c in one
    ]
    if fam == "olmoe":
        assert generate(model, tok, PROMPTS, max_new_tokens=NEW, batch_size=1) == one
        assert generate(model, tok, PROMPTS, max_new_tokens=NEW, batch_size=3) == one


def _stops_from(texts: list[str]) -> list[str]:
    """Two stop strings taken from the middle of some completions, so rows finish at different steps."""
    long = [t for t in texts if len(t) >= 8]
    assert len(long) >= 2, texts
    return [long[0][3:5], long[1][5]]


def _cut(text: str, stops: list[str]) -> str:
    return text[: min([text.find(s) for s in stops if s in text], default=len(text))]


@pytest.mark.parametrize("fam", ["olmoe", "qwen2_moe", "gpt_oss"])
def test_stop_strings_cut_and_rows_leave_the_batch(fam, tok):
    model = build_tiny(fam)
    full = [c[0] for c in generate(model, tok, PROMPTS, max_new_tokens=NEW)]
    stops = _stops_from(full)
    cut_one = generate(model, tok, PROMPTS, max_new_tokens=NEW, stop=stops, batch_size=1)
    cut_all = generate(model, tok, PROMPTS, max_new_tokens=NEW, stop=stops, batch_size=16)
    assert cut_all == cut_one == [[_cut(t, stops)] for t in full]
    assert sum(any(s in t for s in stops) for t in full) >= 2
    assert all(s not in c[0] for c in cut_all for s in stops)


def test_generation_stops_early_once_every_row_hit_a_stop(tok):
    model = build_tiny("olmoe").eval()
    ids = [naive_greedy_ids(model, tok, p, NEW) for p in PROMPTS]
    # Rows that generate a printable ASCII byte after their first token (a byte token b has id b + 3).
    prompts, ids = zip(*[(p, row) for p, row in zip(PROMPTS, ids) if any(32 <= t - 3 < 127 for t in row[1:])])
    assert len(prompts) >= 3
    prompts = list(prompts)
    # Per row, a stop string: the first printable ASCII byte it generates after its first token; a row is
    # finished as soon as it generates a byte of any row's stop.
    stop_bytes = [next(t - 3 for t in row[1:] if 32 <= t - 3 < 127) for row in ids]
    finish = max(next(k for k, t in enumerate(row) if t - 3 in stop_bytes) for row in ids)
    assert finish < NEW - 2
    stops = [chr(b) for b in stop_bytes]
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        got = generate(model, tok, prompts, max_new_tokens=NEW, stop=stops)
    finally:
        handle.remove()
    assert got == [[_cut(tok.decode(row), stops)] for row in ids]
    assert len(calls) == finish + 1  # the prefill makes token 0, decoding step k makes token k


def test_eos_ends_a_row_and_is_not_in_the_text(tok):
    model = build_tiny("olmoe")
    full = [c[0] for c in generate(model, tok, PROMPTS, max_new_tokens=NEW)]
    char = next(c for c in full[1][1:] if " " <= c <= "~")  # an ASCII byte that greedy decoding produces
    eos = encode_prompt(tok, char)[1]
    model.generation_config.eos_token_id = [tok.eos_token_id, eos]
    got = generate(model, tok, PROMPTS, max_new_tokens=NEW, batch_size=3)
    assert got == [[t.split(char)[0]] for t in full]


@pytest.mark.parametrize("fam", ["olmoe", "qwen2_moe", "gpt_oss"])
def test_sampling_is_reproducible_per_seed_and_batch_size_invariant(fam, tok):
    model = build_tiny(fam)
    kw = {"max_new_tokens": 12, "do_sample": True, "temperature": 0.8, "top_p": 0.9, "num_samples": 3}
    a = generate(model, tok, PROMPTS, seed=1, batch_size=16, **kw)
    assert generate(model, tok, PROMPTS, seed=1, batch_size=16, **kw) == a
    assert generate(model, tok, PROMPTS, seed=1, batch_size=5, **kw) == a
    assert generate(model, tok, PROMPTS, seed=2, batch_size=16, **kw) != a
    assert all(len(samples) == 3 for samples in a)
    assert any(len(set(samples)) > 1 for samples in a)  # samples of one prompt differ


def test_sampling_with_tiny_top_p_is_greedy(tok):
    model = build_tiny("qwen2_moe")
    greedy = generate(model, tok, PROMPTS, max_new_tokens=NEW)
    nucleus = generate(model, tok, PROMPTS, max_new_tokens=NEW, do_sample=True, top_p=1e-6, num_samples=2)
    assert nucleus == [[g[0], g[0]] for g in greedy]


def test_first_sampled_token_follows_the_tempered_nucleus_distribution(tok):
    model = build_tiny("olmoe").eval()
    prompt, temperature, top_p, n = "The answer is", 1.5, 0.8, 2000
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([encode_prompt(tok, prompt)])).logits[0, -1, : len(tok)]
    probs = top_p_filter(torch.softmax(logits / temperature, -1), top_p)
    samples = generate(model, tok, [prompt], max_new_tokens=1, do_sample=True, temperature=temperature,
                       top_p=top_p, num_samples=n, batch_size=512)[0]
    # Bytes >= 128 alone all decode to U+FFFD: compare distributions over decoded strings.
    expected: dict[str, float] = {}
    for token in torch.nonzero(probs).flatten().tolist():
        text = tok.decode([token], skip_special_tokens=True)
        expected[text] = expected.get(text, 0.0) + probs[token].item()
    assert 3 <= len(expected) and int((probs > 0).sum()) < len(tok)  # a real nucleus: several tokens, not all
    freq = {text: samples.count(text) / n for text in set(samples)}
    assert set(freq) <= set(expected)
    assert max(abs(freq.get(t, 0.0) - p) for t, p in expected.items()) < 0.04  # >= 3.6 standard errors at n=2000


def test_greedy_num_samples_repeats_the_completion(tok):
    model = build_tiny("olmoe")
    one = generate(model, tok, PROMPTS[:3], max_new_tokens=8)
    assert generate(model, tok, PROMPTS[:3], max_new_tokens=8, num_samples=4) == [c * 4 for c in one]


def test_top_p_filter_hand_computed():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.25, 0.25, 0.25, 0.25]])
    out = top_p_filter(probs, 0.75)
    assert torch.allclose(out[0], torch.tensor([0.0, 0.625, 0.0, 0.375]))
    assert torch.allclose(out[1], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)
    assert torch.allclose(top_p_filter(probs, 0.01)[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_pass_at_1_hand_computed():
    assert pass_at_1([[True, False, True, True], [False] * 4, [True]]) == pytest.approx((0.75 + 0 + 1) / 3)
    assert pass_at_1([[1, 0], [0, 0]]) == 0.25
    with pytest.raises(ValueError, match="prompt 1 has no samples"):
        pass_at_1([[True], []])
    with pytest.raises(ValueError):
        pass_at_1([])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"num_samples": 0}, "num_samples"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": "\n"}, "stop must be a list"),
        ({"stop": [""]}, "stop must be a list"),
    ],
)
def test_bad_arguments_are_named(kwargs, match, tok):
    model = build_tiny("olmoe")
    with pytest.raises(ValueError, match=match):
        generate(model, tok, ["a"], **kwargs)
    with pytest.raises(TypeError, match="list of strings"):
        generate(model, tok, "a")
