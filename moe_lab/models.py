"""Loading models: real checkpoints by hub id or local path, or tiny random models from a config class."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import transformers
from transformers import AutoModelForCausalLM

from .moe.registry import family_spec
from .plain import to_plain

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_dict(value) -> dict:
    return {} if value is None else dict(to_plain(value))


def build_config(config_class: str, overrides: Mapping):
    """An HF config from its class name (e.g. ``OlmoeConfig``) and field overrides, validated."""
    cls = getattr(transformers, config_class, None)
    if cls is None:
        raise ValueError(f"model.config_class={config_class!r} is not a transformers config class")
    config = cls(**_as_dict(overrides))
    validate_config(config)
    return config


def validate_config(config) -> None:
    """Check the family is supported and its routing is well-formed, naming the offending field."""
    spec = family_spec(config.model_type)
    try:
        spec.routing_rule(config)
    except ValueError as err:
        raise ValueError(f"model.config ({config.model_type}): {err}") from None


def keep_fp32_buffers(model) -> None:
    """Floating buffers HF keeps in fp32 whatever the load dtype (``_keep_in_fp32_modules_strict``, e.g. the
    DeepSeek-V3 routing correction bias) back to fp32: ``from_config(dtype=bf16)`` does not honour it."""
    names = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32 and key in names:
                module._buffers[key] = buf.float()


def load_model(model_cfg, tokenizer=None):
    """``(model, tokenizer)`` from a ``conf/model`` entry.

    ``pretrained`` (hub id or local path) loads real weights; otherwise ``config_class`` + ``config``
    builds a randomly initialised model seeded by ``seed``.
    """
    from .data.tokenizer import load_tokenizer

    cfg = _as_dict(model_cfg)
    dtype = DTYPES[cfg.get("dtype") or "float32"]
    pretrained = cfg.get("pretrained")
    if pretrained:
        try:
            config = transformers.AutoConfig.from_pretrained(pretrained)
        except OSError as err:
            from pathlib import Path

            local = str(pretrained).startswith(("/", ".", "~")) or str(pretrained).count("/") != 1
            if local and not Path(str(pretrained)).expanduser().exists():
                raise FileNotFoundError(
                    f"model.pretrained={pretrained}: this path does not exist (working directory {Path.cwd()}); "
                    "point model.pretrained at a local checkpoint folder holding config.json"
                ) from None
            if local:
                raise OSError(f"model.pretrained={pretrained} exists but is not a model folder (no loadable "
                              f"config.json: {err.__class__.__name__}: {str(err).splitlines()[0]})") from None
            raise OSError(
                f"cannot load model {pretrained!r} ({err.__class__.__name__}); without hub access, download it "
                f"elsewhere and set model.pretrained=/local/path/to/{str(pretrained).split('/')[-1]}"
            ) from None
        for key, value in _as_dict(cfg.get("config")).items():
            setattr(config, key, value)
        validate_config(config)
        model = AutoModelForCausalLM.from_pretrained(pretrained, config=config, dtype=dtype)
        tokenizer = tokenizer or load_tokenizer(cfg.get("tokenizer") or pretrained)
    else:
        if not cfg.get("config_class"):
            raise ValueError("model: set either model.pretrained (hub id or path) or model.config_class")
        config = build_config(cfg["config_class"], cfg.get("config"))
        tokenizer = tokenizer or load_tokenizer(cfg.get("tokenizer") or "byte")
        if len(tokenizer) > config.vocab_size:
            raise ValueError(
                f"model.config.vocab_size={config.vocab_size} is smaller than the tokenizer ({len(tokenizer)} "
                f"tokens): raise model.config.vocab_size"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(cfg.get("seed") or 0))
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        keep_fp32_buffers(model)
    if tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
