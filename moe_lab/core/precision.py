"""fp32 master weights (docs/design.md "Precision"): what a run does with trainable bf16/fp16 parameters.

Plain AdamW on bf16 parameters drops every update smaller than half the bf16 spacing of the parameter (at
lr 2e-5 most of them; a weight of 1.0 never moves). ``method.master_weights`` decides, once per fit, before
the strategy wraps the model:

- ``fp32`` (default): upcast the trainable half-precision parameters to fp32; ``trainer.precision`` keeps
  the compute dtype (``bf16-mixed`` autocasts matmuls to bf16). ``model.dtype`` stays the load dtype, so
  frozen weights keep their half-precision memory. Under a full-precision trainer (``32-true``) every
  half-precision parameter is upcast, frozen ones too (fp32 activations cannot meet bf16 weights). Under
  DeepSpeed nothing changes: its optimizer keeps fp32 master copies itself.
- ``optimizer``: trainable bf16 parameters stay bf16 for compute, the optimizer steps fp32 master copies
  (:mod:`moe_lab.runtime.optimizer_masters`; bf16-mixed only, refused where it cannot run). Faster where autocast's per-step
  casts of fp32 weights cost (a GPU); gradients accumulate over micro-batches in bf16.
- ``check``: change nothing; refuse to train half-precision parameters with a plain optimizer.
- ``off``: train parameters in their own dtype, knowingly.

Half "-true" precisions (``bf16-true``, ``16-true``) cast every parameter and buffer (router biases
included) to half precision, so they are refused unless ``master_weights=off``.

Exports (:func:`export_in_load_dtype`) write every tensor in the load dtype, whatever master weights did, but
those transformers itself keeps in fp32 for that dtype (:func:`hf_fp32_pattern`; DeepSeek-V3's routing correction
bias, and from transformers 5.24 the DeepSeek-V2/V3 router weights), which are written in fp32 as from_pretrained
holds them.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

MODES = ("fp32", "optimizer", "check", "off")
HALF = (torch.bfloat16, torch.float16)
HALF_TRUE = ("bf16-true", "16-true")
AUTOCAST = ("bf16-mixed", "16-mixed")


def check_mode(mode: str) -> str:
    """Validate ``method.master_weights``."""
    if mode not in MODES:
        raise ValueError(f"method.master_weights={mode!r} is unknown: choose one of {MODES}")
    return mode


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_master_weights(model: nn.Module, precision: str, mode: str = "fp32",
                        optimizer_keeps_fp32: bool = False) -> list[nn.Parameter]:
    """The parameters to upcast to fp32 under ``mode`` and ``trainer.precision`` (raises where the run would
    silently drop updates). ``optimizer_keeps_fp32``: the strategy's optimizer holds fp32 copies (DeepSpeed)."""
    check_mode(mode)
    precision = str(precision)
    params = list(model.parameters())
    half_trainable = [p for p in params if p.requires_grad and p.dtype in HALF]
    if mode == "off" or optimizer_keeps_fp32:
        return []
    if precision in HALF_TRUE:
        raise ValueError(
            f"trainer.precision={precision} casts every parameter and buffer (router biases included) to half "
            "precision, and plain AdamW then drops updates smaller than the bf16 spacing (at lr 2e-5 most of "
            "them): use trainer.precision=bf16-mixed (fp32 master weights under bf16 autocast; model.dtype may "
            "stay bfloat16), or set method.master_weights=off to accept it")
    if mode == "optimizer":
        if not half_trainable:
            raise ValueError(
                f"method.master_weights=optimizer keeps bf16 compute weights, but no trainable parameter is half "
                f"precision (model.dtype={_dtype_name(model.dtype)}): set model.dtype=bfloat16, or "
                "method.master_weights=fp32")
        return []  # the weights stay as loaded; the optimizer gets fp32 copies (optimizer_masters)
    if not half_trainable:
        return []
    dtype = _dtype_name(half_trainable[0].dtype)
    if mode == "check":
        raise ValueError(
            f"{len(half_trainable)} trainable parameters are {dtype} (model.dtype={dtype}) and "
            f"trainer.precision={precision} trains them with plain AdamW, which drops updates smaller than the "
            f"{dtype} spacing: set method.master_weights=fp32 (upcast them), model.dtype=float32, or "
            "method.master_weights=off to accept it")
    if precision in AUTOCAST:
        return half_trainable
    return [p for p in params if p.dtype in HALF]  # full-precision compute: no half weight may remain


def apply_master_weights(model: nn.Module, precision: str, mode: str = "fp32",
                         optimizer_keeps_fp32: bool = False) -> list[nn.Parameter]:
    """Upcast the planned parameters in place (the same Parameter objects, so hooks and optimizer groups
    stay valid) and say so in one log line. Returns the upcast parameters."""
    todo = plan_master_weights(model, precision, mode, optimizer_keeps_fp32)
    if optimizer_keeps_fp32 and mode != "off":
        log.info("master weights: the strategy's optimizer keeps fp32 copies; parameters stay as loaded")
    elif mode == "optimizer":
        half = [p for p in model.parameters() if p.requires_grad and p.dtype in HALF]
        log.info("master weights: %d trainable %s tensors (%d entries) stay %s for compute; the optimizer steps fp32 "
                 "copies (method.master_weights=optimizer); gradients accumulate in %s over a window's micro-batches",
                 len(half), _dtype_name(half[0].dtype), sum(p.numel() for p in half), _dtype_name(half[0].dtype),
                 _dtype_name(half[0].dtype))
    if not todo:
        return []
    source = _dtype_name(todo[0].dtype)
    model._moe_lab_load_dtype = getattr(model, "_moe_lab_load_dtype", None) or todo[0].dtype  # for exports
    with torch.no_grad():
        for p in todo:
            p.data = p.data.float()
    left = sum(1 for p in model.parameters() if p.dtype in HALF)
    log.info("master weights: upcast %d parameter tensors (%d entries) from %s to float32 "
             "(method.master_weights=%s, model.dtype=%s, trainer.precision=%s); %d frozen tensors stay %s",
             len(todo), sum(p.numel() for p in todo), source, mode, source, precision, left, source)
    return todo


def load_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ``model`` was loaded in: recorded by :func:`apply_master_weights` before it upcasts, else
    ``config.dtype`` (what ``from_pretrained(dtype=...)`` set), else ``model.dtype``."""
    dtype = getattr(model, "_moe_lab_load_dtype", None) or getattr(model.config, "dtype", None) or model.dtype
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def hf_fp32_pattern(model: nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """The names ``from_pretrained(dtype=dtype)`` keeps in fp32 (``model._get_dtype_plan``: the class's
    ``_keep_in_fp32_modules_strict`` for bf16/fp16, ``_keep_in_fp32_modules`` for fp16), as the regex transformers
    matches them with (``pattern.search(name)``); None when it keeps nothing."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return None
    from transformers.core_model_loading import build_glob_alternation

    return build_glob_alternation(list(plan))[0]


def keep_hf_fp32(model, dtype: torch.dtype) -> None:
    """The parameters and buffers ``from_pretrained(dtype=dtype)`` keeps in fp32 (:func:`hf_fp32_pattern`:
    DeepSeek-V3's routing correction bias; from transformers 5.24 the DeepSeek-V2/V3 router weights) back to fp32 in
    a model built with ``from_config(dtype=dtype)``, which honours only what the module code creates in fp32."""
    keep = hf_fp32_pattern(model, dtype)
    if keep is None:
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype != torch.float32 and keep.search(name):
                param.data = param.data.float()
        for name, buf in list(model.named_buffers()):
            if buf.is_floating_point() and buf.dtype != torch.float32 and keep.search(name):
                owner, _, key = name.rpartition(".")
                model.get_submodule(owner)._buffers[key] = buf.float()


def in_load_dtype(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every floating tensor cast once to :func:`load_dtype`, except those HF itself keeps in
    fp32 for that dtype (:func:`hf_fp32_pattern`: DeepSeek-V3's routing correction bias, from transformers 5.24
    the DeepSeek-V2/V3 router weights), written in fp32 (a lossless upcast where a strategy cast them down, as
    DeepSpeed's bf16 engine does). Tensors sharing storage (tied weights) still share it."""
    dtype = load_dtype(model)
    keep = hf_fp32_pattern(model, dtype)
    out, cast = {}, {}
    for key, value in state.items():
        if value.is_floating_point() and keep is not None and keep.search(key):
            out[key] = value if value.dtype == torch.float32 else value.detach().float()
            continue
        if not value.is_floating_point() or value.dtype == dtype:
            out[key] = value
            continue
        ident = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
        if ident not in cast:
            cast[ident] = value.detach().to(dtype)
        out[key] = cast[ident]
    return out


def _state_in_load_dtype(patch, inner=None) -> dict[str, torch.Tensor]:
    return in_load_dtype(patch.model, inner() if inner is not None else patch.model.state_dict())


def config_in_load_dtype(model: nn.Module, directory) -> None:
    """``config.json``'s ``dtype`` := the load dtype (``save_pretrained`` writes the first parameter's dtype,
    fp32 for a trained embedding under master weights), in the file and in ``model.config``."""
    name = _dtype_name(load_dtype(model))
    model.config.dtype = name
    path = Path(directory) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        config["dtype"] = name
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_in_load_dtype(patch) -> None:
    """Make ``patch.export`` write every tensor in the model's load dtype (:func:`in_load_dtype`; fp32 master
    weights and LoRA merges, computed in fp32, are cast once) and say so in ``config.json``. Idempotent."""
    if getattr(patch, "_exports_in_load_dtype", False):
        return
    patch.export_state_dict = functools.partial(_state_in_load_dtype, patch, patch.export_state_dict)
    patch.export_hooks.insert(0, functools.partial(config_in_load_dtype, patch.model))
    patch._exports_in_load_dtype = True
