"""Data layer: tokenizers, prompts, row formats (LLM-Adapters, chat, reasoning, text), packing, resumable
loaders and the SFT / text-block DataModules.

Each name below is imported from its module on first use (PEP 562), so importing one module of the package (the
shipped-data resolver config composition needs, a row format) does not load Lightning and the data modules.
"""

from __future__ import annotations

from importlib import import_module

#: public name -> the module of this package that defines it
EXPORTS = {
    "BYTE_VOCAB_SIZE": "tokenizer",
    "IGNORE_INDEX": "collate",
    "OVERFLOW_POLICIES": "collate",
    "ReasoningFormat": "reasoning",
    "ResumableDataLoader": "resumable",
    "ResumableSampler": "resumable",
    "SFTDataModule": "datamodule",
    "SOURCES": "datamodule",
    "TextBlockDataModule": "text",
    "assemble": "collate",
    "build_byte_tokenizer": "tokenizer",
    "build_prompt": "prompts",
    "chat_prompt_ids": "chat",
    "chat_segments": "chat",
    "encode_prompt": "collate",
    "format_chat": "prompts",
    "format_prompt": "prompts",
    "is_packed": "packing",
    "load_llm_adapters": "llm_adapters",
    "load_tokenizer": "tokenizer",
    "model_inputs": "packing",
    "pack_examples": "packing",
    "packed_collate": "packing",
    "pad_collate": "collate",
    "real_token_mask": "packing",
    "synthetic_math_rows": "synthetic",
    "tokenize_example": "collate",
    "verify_packing": "packing",
}
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


def __getattr__(name: str):
    if name in EXPORTS:
        value = getattr(import_module(f"{__name__}.{EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
