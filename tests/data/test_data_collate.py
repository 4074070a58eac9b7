import torch

from moe_lab.data.collate import IGNORE_INDEX, encode_prompt, pad_collate, tokenize_example
from moe_lab.data.tokenizer import build_byte_tokenizer


def _byte_ids(text):
    return [b + 3 for b in text.encode()]


def test_labels_mask_prompt_and_train_response_plus_eos():
    tok = build_byte_tokenizer()
    ex = tokenize_example(tok, "Q: 2+2?\nA:", " 4 ✓", max_length=100)
    prompt, response = _byte_ids("Q: 2+2?\nA:"), _byte_ids(" 4 ✓")
    assert ex["input_ids"] == [1] + prompt + response + [2]
    assert ex["labels"] == [IGNORE_INDEX] * (1 + len(prompt)) + response + [2]


def test_no_double_bos_when_prompt_text_has_it():
    tok = build_byte_tokenizer()
    tok.split_special_tokens = False  # let "<s>" in text become the bos token (as chat templates do)
    ids = encode_prompt(tok, "<s>hi")
    assert ids == [1] + _byte_ids("hi")


def test_truncation_keeps_prompt_start_and_skips_when_no_response_left():
    tok = build_byte_tokenizer()
    prompt, response = "abcdef", "XYZ"
    ex = tokenize_example(tok, prompt, response, max_length=9)  # bos + 6 prompt + 2 response tokens
    assert ex["input_ids"] == [1] + _byte_ids("abcdef") + _byte_ids("XY")
    assert ex["labels"] == [IGNORE_INDEX] * 7 + _byte_ids("XY")
    assert tokenize_example(tok, prompt, response, max_length=7) is None  # only bos + prompt fit
    assert tokenize_example(tok, prompt, response, max_length=4) is None
    assert tokenize_example(tok, prompt, "", max_length=8)["labels"] == [IGNORE_INDEX] * 7 + [2]


def test_pad_collate():
    batch = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8], "labels": [8]},
        {"input_ids": [9, 10], "labels": [-100, -100]},
    ]
    out = pad_collate(batch, pad_id=0)
    assert all(v.dtype == torch.long for v in out.values())
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100], [-100, -100, -100]]
    assert pad_collate(batch, pad_id=42)["input_ids"][1].tolist() == [8, 42, 42]
