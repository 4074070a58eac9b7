import pytest
from transformers import AutoTokenizer

from moe_lab.data.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer, load_tokenizer

TEXTS = [
    "hello , world !",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "héllo wörld — ünïcödé 世界 🙂👍🏽",
    "literal <s> and </s> and <pad> stay text",
    "",
]


def test_special_ids_and_size():
    tok = build_byte_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<s>", "</s>"]
    assert len(tok) == BYTE_VOCAB_SIZE == 259
    assert tok.chat_template is None


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_byte_ids(text):
    tok = build_byte_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [b + 3 for b in text.encode("utf-8")]  # independent: one id per UTF-8 byte
    assert tok.decode(ids) == text
    with_bos = tok(text)["input_ids"]
    assert with_bos == [1] + ids
    assert tok.decode(with_bos, skip_special_tokens=True) == text


def test_every_byte_has_an_id():
    tok = build_byte_tokenizer()
    text = bytes(range(128)).decode("ascii") + "".join(chr(c) for c in range(0x80, 0x800, 7))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert sorted(set(ids)) == sorted({b + 3 for b in text.encode()})
    assert tok.decode(ids) == text


def test_save_load_identical(tmp_path):
    tok = build_byte_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == BYTE_VOCAB_SIZE
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text


def test_load_tokenizer(tmp_path):
    assert len(load_tokenizer(None)) == BYTE_VOCAB_SIZE
    assert load_tokenizer("byte")("a")["input_ids"] == [1, 100]
    build_byte_tokenizer().save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path))("a")["input_ids"] == [1, 100]


def test_load_tokenizer_missing_path_is_clear(tmp_path):
    missing = str(tmp_path / "no_such_tokenizer")
    with pytest.raises(OSError) as info:
        load_tokenizer(missing)
    assert missing in str(info.value)
    assert "model.tokenizer=/local/path" in str(info.value)
