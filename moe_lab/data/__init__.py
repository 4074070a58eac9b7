"""Data layer: tokenizers, prompts, datasets (synthetic and LLM-Adapters) and the SFT DataModule."""

from moe_lab.data.collate import IGNORE_INDEX, encode_prompt, pad_collate, tokenize_example
from moe_lab.data.datamodule import SOURCES, SFTDataModule
from moe_lab.data.llm_adapters import load_llm_adapters
from moe_lab.data.prompts import build_prompt, format_chat, format_prompt
from moe_lab.data.synthetic import synthetic_math_rows
from moe_lab.data.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer, load_tokenizer

__all__ = [
    "BYTE_VOCAB_SIZE",
    "IGNORE_INDEX",
    "SOURCES",
    "SFTDataModule",
    "build_byte_tokenizer",
    "build_prompt",
    "encode_prompt",
    "format_chat",
    "format_prompt",
    "load_llm_adapters",
    "load_tokenizer",
    "pad_collate",
    "synthetic_math_rows",
    "tokenize_example",
]
