"""Checks that run before anything is loaded, so a mistyped number or a missing device fails in a second
with the config field and the fix, not minutes later deep inside Lightning or torch."""

from __future__ import annotations

import logging
import netrc
import os
import socket
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from ..core.settings import Optim, RunLength, Schedule, number, read, read_loop

log = logging.getLogger(__name__)

# field -> (kind, smallest allowed value, strictly greater?) of a task=finetune run (a finetune that would not move its
# weights, lr 0, is refused); task.optim, task.scheduler and task.trainer are read by their settings classes
FINETUNE_NUMBERS = {
    "task.optim.lr": ("float", 0.0, True),
    "task.checkpoint_every_n_steps": ("int", 1, False),
    "dataset.batch_size": ("int", 1, False),
    "dataset.max_length": ("int", 1, False),
}


def check_length(cfg: DictConfig) -> None:
    """The run ends: ``max_steps >= 1``, or ``max_steps=-1`` with ``max_epochs >= 1`` (an epoch-based run, as the
    papers' presets are; its optimizer steps follow from the data: :class:`moe_lab.core.settings.RunLength`)."""
    RunLength.of(OmegaConf.select(cfg, "task.trainer", default=None))


def check_numbers(cfg: DictConfig) -> None:
    """Every numeric training field has the right type and range (``max_steps=1k``, ``lr=-1``, ...)."""
    check_length(cfg)
    for field, (kind, low, strict) in FINETUNE_NUMBERS.items():
        value = OmegaConf.select(cfg, field, default=None)
        if value is None:
            continue
        value = number(field, value, kind)
        if value < low or (strict and value == low):
            relation = f"> {low}" if strict else f">= {low}"
            raise ValueError(f"{field}={value} must be {relation}")
    read(Optim, OmegaConf.select(cfg, "task.optim", default=None), "task.optim")
    read(Schedule, OmegaConf.select(cfg, "task.scheduler", default=None), "task.scheduler")
    loop = read_loop(OmegaConf.select(cfg, "task.trainer", default=None))
    interval, accumulate = loop.get("val_check_interval"), int(loop.get("accumulate_grad_batches") or 1)
    if isinstance(interval, int) and interval > 1 and accumulate > 1:  # Lightning counts micro-batches
        log.info("task.trainer.val_check_interval=%d counts training batches: with accumulate_grad_batches=%d "
                 "validation runs every %g optimizer steps", interval, accumulate, interval / accumulate)


def check_hardware(cfg: DictConfig) -> None:
    """``hardware=gpu`` on a machine without CUDA names ``hardware=cpu`` instead of failing in Lightning."""
    accelerator = str(OmegaConf.select(cfg, "hardware.trainer.accelerator", default="auto"))
    if accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"hardware.trainer.accelerator={accelerator}, but torch {torch.__version__} sees no "
                               "CUDA device on this machine: use hardware=cpu (or hardware=ddp_cpu for 2 processes)")


def _wandb_key_present(host: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def check_wandb(cfg: DictConfig, timeout_s: float = 3.0) -> None:
    """With a W&B logger and no API key or no route to the W&B server, switch to ``WANDB_MODE=offline`` at once
    (one line says so and how to sync later) instead of failing after a long network timeout."""
    nodes = [n for n in (cfg.get("logger") or {}).values()
             if n is not None and str(n.get("_target_", "")).endswith("WandbLogger")]
    if not nodes or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun") \
            or all(n.get("offline") for n in nodes):
        return
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host = url.hostname or "api.wandb.ai"
    if not _wandb_key_present(host):
        reason = "no W&B API key (WANDB_API_KEY or `wandb login`)"
    else:
        try:
            socket.create_connection((host, url.port or 443), timeout=timeout_s).close()
            return
        except OSError as err:
            reason = f"{host} is unreachable ({type(err).__name__})"
    os.environ["WANDB_MODE"] = "offline"
    log.warning("logger=wandb: %s, logging offline (WANDB_MODE=offline); upload later with `wandb sync`", reason)
