"""fp32 master weights (DESIGN.md "Precision"): what a run does with trainable bf16/fp16 parameters.

Plain AdamW on bf16 parameters drops every update smaller than half the bf16 spacing of the parameter (at
lr 2e-5 most of them; a weight of 1.0 never moves). ``method.master_weights`` decides, once per fit, before
the strategy wraps the model:

- ``fp32`` (default): upcast the trainable half-precision parameters to fp32; ``trainer.precision`` keeps
  the compute dtype (``bf16-mixed`` autocasts matmuls to bf16). ``model.dtype`` stays the load dtype, so
  frozen weights keep their half-precision memory. Under a full-precision trainer (``32-true``) every
  half-precision parameter is upcast, frozen ones too (fp32 activations cannot meet bf16 weights). Under
  DeepSpeed nothing changes: its optimizer keeps fp32 master copies itself.
- ``check``: change nothing; refuse to train half-precision parameters with a plain optimizer.
- ``off``: train parameters in their own dtype, knowingly.

Half "-true" precisions (``bf16-true``, ``16-true``) cast every parameter and buffer (router biases
included) to half precision, so they are refused unless ``master_weights=off``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

MODES = ("fp32", "check", "off")
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
    if not todo:
        return []
    source = _dtype_name(todo[0].dtype)
    with torch.no_grad():
        for p in todo:
            p.data = p.data.float()
    left = sum(1 for p in model.parameters() if p.dtype in HALF)
    log.info("master weights: upcast %d parameter tensors (%d entries) from %s to float32 "
             "(method.master_weights=%s, model.dtype=%s, trainer.precision=%s); %d frozen tensors stay %s",
             len(todo), sum(p.numel() for p in todo), source, mode, source, precision, left, source)
    return todo
