"""Gradient-norm monitoring, total and per parameter group (router, experts, attention, ...)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from moe_lab.moe.patch import PARAMETER_GROUPS

from ._logging import log_metrics, logging_step


class GradNormCallback(Callback):
    """Log ``grad_norm/total`` and ``grad_norm/{group}`` for the groups of ``pl_module.patch``.

    Groups come from ``pl_module.patch.parameter_groups()`` (router, experts, shared_experts,
    attention, embeddings, other); parameters of the LightningModule outside the patched model count as
    ``other``. Parameters without a gradient are skipped and a group with no gradient at all is not
    logged. For any ``norm_type`` p the total satisfies ``total = (sum_g group_g ** p) ** (1 / p)``
    (max over groups for ``inf``). Without a ``patch`` attribute only the total is logged.

    Runs in ``on_before_optimizer_step``, i.e. once per optimizer step (after all accumulated
    micro-batches), and logs when ``(trainer.global_step + 1) % log_every_n_steps == 0``: the norm of
    optimizer step ``k`` is logged for ``k % n == 0``, at Lightning's logging step ``k - 1`` (the step of
    that batch's ``train/loss`` and of ``ExpertLoadCallback``'s metrics). Values are written once to every
    logger on rank zero (not through Lightning's ``log_dict`` flush, see :mod:`moe_lab.callbacks._logging`)
    and mirrored into ``trainer.callback_metrics``. ``self.latest`` holds the last logged values.

    What the gradients are at that point (Lightning 2.6):

    * fp32 / bf16-mixed: the true gradients (on CPU, Lightning runs ``16-mixed`` as bf16, no scaler). Under DDP they are already all-reduced (identical on every
      rank), so nothing is synced.
    * 16-mixed (``MixedPrecision`` with a ``GradScaler``): the precision plugin calls
      ``scaler.unscale_(optimizer)`` *before* this hook, so the norms are unscaled, except for optimizers
      that unscale inside ``step()`` (e.g. fused Adam), whose gradients are still multiplied by the loss
      scale here. Steps the scaler will skip show ``inf``/``nan`` norms.
    * Norms are taken before Lightning's gradient clipping (which runs right after this hook).
    * Under expert parallelism (``hardware.ep_size``) each rank holds a slice of every layer's experts: their norms
      are summed over the EP group (one all-reduce), so every rank logs the whole model's values.
    * Sharded strategies (FSDP, DeepSpeed ZeRO) keep partial or no ``.grad`` per rank; the norms are then
      those of the local shards only (or nothing is logged when no ``.grad`` exists).
    """

    def __init__(self, log_every_n_steps: int = 1, norm_type: float | str = 2.0):
        super().__init__()
        if log_every_n_steps < 1:
            raise ValueError("log_every_n_steps must be >= 1")
        self.log_every_n_steps = int(log_every_n_steps)
        self.norm_type = float(norm_type)
        if not (self.norm_type > 0):
            raise ValueError(f"norm_type must be positive (or 'inf'), got {norm_type!r}")
        self.latest: dict[str, float] = {}
        self._groups: dict[str, list[nn.Parameter]] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._groups = None  # parameters may have been replaced (PEFT, strategy wrapping) since the last fit

    def _parameter_groups(self, pl_module: pl.LightningModule) -> dict[str, list[nn.Parameter]]:
        if self._groups is None:
            patch = getattr(pl_module, "patch", None)
            if patch is None:
                groups = {"other": list(pl_module.parameters())}
            else:
                groups = {name: [p for _, p in params] for name, params in patch.parameter_groups().items()}
                seen = {id(p) for params in groups.values() for p in params}
                extra = [p for p in pl_module.parameters() if id(p) not in seen]
                groups.setdefault("other", []).extend(extra)
            self._groups = groups
        return self._groups

    def grad_norms(self, pl_module: pl.LightningModule) -> dict[str, float]:
        """``{"grad_norm/total": ..., "grad_norm/<group>": ...}`` for the current gradients ({} if none)."""
        groups = self._parameter_groups(pl_module)
        p = self.norm_type
        names, norms, grads_of = [], [], []  # one norm per parameter with a gradient, computed once, in fp32
        for name, params in groups.items():
            for param in params:
                if param.grad is not None:
                    names.append(name)
                    grads_of.append(param)
                    norms.append(torch.linalg.vector_norm(param.grad.detach(), p, dtype=torch.float32))
        if not norms:
            return {}
        device = norms[0].device
        norms_t = torch.stack([n.to(device) for n in norms])
        expert_parallel = getattr(getattr(pl_module, "patch", None), "expert_parallel", None)
        if expert_parallel is not None:  # each rank holds a slice of the experts: their norms over the EP group
            local = {id(q) for q in expert_parallel.local_parameters}
            sliced = torch.tensor([id(q) in local for q in grads_of], device=device)
            powers = expert_parallel.reduce_over_ep(torch.where(sliced, norms_t.double() ** p, 0.0))
            norms_t = torch.where(sliced, powers ** (1.0 / p), norms_t.double()).float()
        values = [torch.linalg.vector_norm(norms_t, p)]
        keys = ["grad_norm/total"]
        if getattr(pl_module, "patch", None) is not None:
            for group in PARAMETER_GROUPS:
                idx = [i for i, n in enumerate(names) if n == group]
                if idx:
                    keys.append(f"grad_norm/{group}")
                    values.append(torch.linalg.vector_norm(norms_t[idx], p))
        return dict(zip(keys, torch.stack(values).tolist()))  # a single device sync

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if (trainer.global_step + 1) % self.log_every_n_steps != 0:
            return
        metrics = self.grad_norms(pl_module)
        if not metrics:
            return
        self.latest = {**metrics, "step": trainer.global_step + 1}
        log_metrics(trainer, pl_module, metrics, logging_step(trainer))
