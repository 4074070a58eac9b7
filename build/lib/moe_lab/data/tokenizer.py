"""Tokenizers: an offline byte-level tokenizer for tiny models, and a loader for real ones."""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
NUM_SPECIAL_TOKENS = 3
#: ``len(build_byte_tokenizer())``: 3 special tokens followed by the 256 bytes (byte ``b`` has id ``b + 3``).
BYTE_VOCAB_SIZE = NUM_SPECIAL_TOKENS + 256


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable unicode character (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Build a byte-level tokenizer in code (no downloads).

    Ids: 0=``<pad>``, 1=``<s>`` (bos), 2=``</s>`` (eos), then byte ``b`` -> ``b + 3``. Encoding adds bos
    (like Llama tokenizers); ``decode(encode(s), skip_special_tokens=True) == s`` for any str, including
    text that contains the literal strings ``<s>``/``</s>`` (special tokens are never matched in text).
    No chat template. Survives ``save_pretrained`` + ``AutoTokenizer.from_pretrained``.
    """
    byte_chars = _bytes_to_unicode()
    vocab = {PAD_TOKEN: 0, BOS_TOKEN: 1, EOS_TOKEN: 2}
    vocab.update({byte_chars[b]: NUM_SPECIAL_TOKENS + b for b in range(256)})
    # BPE without merges over the ByteLevel alphabet: every byte is exactly one token.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, 1)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="right",
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
    )
    assert len(tok) == BYTE_VOCAB_SIZE, len(tok)
    return tok


def _looks_local(name: str) -> bool:
    return os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name)


def load_tokenizer(name_or_path: str | None) -> PreTrainedTokenizerBase:
    """Return the byte tokenizer for ``None``/``"byte"``, else ``AutoTokenizer.from_pretrained(name_or_path)``.

    A missing local path or an unreachable hub id raises ``OSError`` naming it and the
    ``model.tokenizer=/local/path`` override. The result always has a pad token (eos as fallback).
    """
    if name_or_path is None or name_or_path == "byte":
        return build_byte_tokenizer()
    hint = (
        f"Could not load tokenizer {name_or_path!r}: not a local directory and the Hugging Face hub is "
        "unreachable (or the id does not exist). Download it where there is internet and point to it "
        "with the Hydra override `model.tokenizer=/local/path`."
    )
    path = os.path.expanduser(name_or_path)
    if _looks_local(name_or_path) and not os.path.exists(path):
        raise OSError(f"{hint} (path does not exist)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise OSError(f"{hint} Original error: {err}") from err
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"Tokenizer {name_or_path!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok
