"""Loading models: real checkpoints by hub id or local path, or tiny random models from a config class."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import transformers
from transformers import AutoModelForCausalLM

from .core.plain import to_plain
from .core.precision import keep_hf_fp32
from .moe.experts_backend import set_experts_implementation
from .moe.registry import family_spec, supported_families

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_dict(value) -> dict:
    return {} if value is None else dict(to_plain(value))


def build_config(config_class: str, overrides: Mapping, method: str | None = None, dense: bool = False):
    """An HF config from its class name (e.g. ``OlmoeConfig``) and field overrides, validated
    (:func:`check_model_type`: ``dense`` accepts a dense causal LM)."""
    cls = getattr(transformers, config_class, None)
    if cls is None:
        raise ValueError(f"model.config_class={config_class!r} is not a transformers config class")
    config = cls(**_as_dict(overrides))
    check_model_type(config, method, f"model.config_class={config_class}", dense)
    return config


def check_model_type(config, method: str | None = None, source: str = "model", dense: bool = False) -> None:
    """An MoE family of moe/registry.py is validated (:func:`validate_config`); any other model type is a dense
    causal LM, accepted only when ``dense`` (the caller trains or reads any causal LM: a method whose LightningModule
    sets ``trains_dense_models``, a KD teacher). ``method``: the Hydra method name the model is loaded for (None: no
    method), for the error; ``source``: where the config came from, for the error."""
    if config.model_type in supported_families():
        validate_config(config)
        return
    if dense:
        return
    families = ", ".join(supported_families())
    dense_ones = "a method whose LightningModule sets trains_dense_models (distillation, e.g. method=kd)"
    if method is None:
        raise ValueError(f"{source}: unsupported model_type {config.model_type!r}: moe-lab supports {families}; "
                         f"a dense causal LM loads only for {dense_ones}")
    raise ValueError(f"method={method} trains MoE models, but {source} is a dense {config.model_type!r} model "
                     f"(moe-lab's MoE families: {families}); a dense model trains only under {dense_ones}")


def validate_config(config) -> None:
    """Check the family is supported and its routing is well-formed, naming the offending field."""
    spec = family_spec(config.model_type)
    try:
        spec.routing_rule(config)
    except ValueError as err:
        raise ValueError(f"model.config ({config.model_type}): {err}") from None


def load_model(model_cfg, tokenizer=None, method: str | None = None, dense: bool = False):
    """``(model, tokenizer)`` from a ``conf/model`` entry.

    ``pretrained`` (hub id or local path) loads real weights; otherwise ``config_class`` + ``config``
    builds a randomly initialised model seeded by ``seed``. ``experts_implementation`` picks transformers' experts
    kernel (:mod:`moe_lab.moe.experts_backend`; null keeps transformers' default). ``dense``: a dense causal LM is
    accepted besides the MoE families; ``method``: the Hydra method name the model is loaded for, named in the
    refusal (:func:`check_model_type`).
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
        from .core.export_check import check_export

        check_export(pretrained, "model.pretrained")
        overrides = _as_dict(cfg.get("config"))
        if overrides and cfg.get("config_class") and type(config).__name__ != cfg["config_class"]:
            raise ValueError(
                f"model.pretrained={pretrained} holds a {type(config).__name__} (model_type {config.model_type!r}) "
                f"but model.config_class={cfg['config_class']}: model.config describes another architecture; "
                "add model.config_class=null model.config=null to load the checkpoint as saved")
        for key, value in overrides.items():
            setattr(config, key, value)
        check_model_type(config, method, f"model.pretrained={pretrained}", dense)
        model = AutoModelForCausalLM.from_pretrained(pretrained, config=config, dtype=dtype)
        tokenizer = tokenizer or load_tokenizer(cfg.get("tokenizer") or pretrained)
    else:
        if not cfg.get("config_class"):
            raise ValueError("model: set either model.pretrained (hub id or path) or model.config_class")
        config = build_config(cfg["config_class"], cfg.get("config"), method, dense)
        tokenizer = tokenizer or load_tokenizer(cfg.get("tokenizer") or "byte")
        if len(tokenizer) > config.vocab_size:
            raise ValueError(
                f"model.config.vocab_size={config.vocab_size} is smaller than the tokenizer ({len(tokenizer)} "
                f"tokens): raise model.config.vocab_size"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(cfg.get("seed") or 0))
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        keep_hf_fp32(model, dtype)
    set_experts_implementation(model, cfg.get("experts_implementation"))
    if tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
