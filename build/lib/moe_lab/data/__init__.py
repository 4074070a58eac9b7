"""Data layer: tokenizers, prompts, row formats (LLM-Adapters, chat, reasoning, text), packing, resumable
loaders and the SFT / text-block DataModules."""

from moe_lab.data.chat import chat_prompt_ids, chat_segments
from moe_lab.data.collate import (
    IGNORE_INDEX,
    OVERFLOW_POLICIES,
    assemble,
    encode_prompt,
    pad_collate,
    tokenize_example,
)
from moe_lab.data.datamodule import SOURCES, SFTDataModule
from moe_lab.data.llm_adapters import load_llm_adapters
from moe_lab.data.packing import (
    is_packed,
    model_inputs,
    pack_examples,
    packed_collate,
    real_token_mask,
    verify_packing,
)
from moe_lab.data.prompts import build_prompt, format_chat, format_prompt
from moe_lab.data.reasoning import ReasoningFormat
from moe_lab.data.resumable import ResumableDataLoader, ResumableSampler
from moe_lab.data.synthetic import synthetic_math_rows
from moe_lab.data.text import TextBlockDataModule
from moe_lab.data.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer, load_tokenizer

__all__ = [
    "BYTE_VOCAB_SIZE",
    "IGNORE_INDEX",
    "OVERFLOW_POLICIES",
    "SOURCES",
    "ReasoningFormat",
    "ResumableDataLoader",
    "ResumableSampler",
    "SFTDataModule",
    "TextBlockDataModule",
    "assemble",
    "build_byte_tokenizer",
    "build_prompt",
    "chat_prompt_ids",
    "chat_segments",
    "encode_prompt",
    "format_chat",
    "format_prompt",
    "is_packed",
    "load_llm_adapters",
    "load_tokenizer",
    "model_inputs",
    "pack_examples",
    "packed_collate",
    "pad_collate",
    "real_token_mask",
    "synthetic_math_rows",
    "tokenize_example",
    "verify_packing",
]
