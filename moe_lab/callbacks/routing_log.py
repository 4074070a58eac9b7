"""Routing log: per optimizer step, per MoE layer, how many real tokens each expert received (all ranks summed).

Opt in with ``+callbacks=routing_log`` (conf/callbacks/routing_log.yaml). Writes ``<run dir>/routing_log.jsonl``:
a header line (model signature) and one line per recorded step, ``{"step": s, "counts": [[...] per layer]}``.
``task=offload`` reads it (and refuses a log of another model).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from ._dense import without_moe_layers

LOG_FILE = "routing_log.jsonl"


def model_signature(model, name: str | None = None, layers=None) -> dict:
    """What a routing log must match: model type, MoE layer indices, expert counts and top-k. ``layers``: objects
    with ``index``, ``num_experts``, ``top_k`` (a patch's MoE blocks); default the model's MoE layer views."""
    from ..moe.view import find_moe_layers

    views = find_moe_layers(model) if layers is None else layers
    return {"model": name or getattr(model.config, "_name_or_path", "") or model.config.model_type,
            "model_type": model.config.model_type, "layers": [v.index for v in views],
            "num_experts": [v.num_experts for v in views], "top_k": [v.top_k for v in views]}


class RoutingLogCallback(Callback):
    """Record per-step per-layer expert token counts from the MoE blocks' ``total_counts`` (deltas since the
    previous recorded step, summed over data-parallel ranks; a collective, every rank calls it)."""

    def __init__(self, every_n_steps: int = 1, path: str | os.PathLike | None = None, model_name: str | None = None):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError("callbacks.routing_log.every_n_steps must be >= 1")
        self.every_n_steps = int(every_n_steps)
        self.path = None if path is None else Path(path)
        self.model_name = model_name
        self._base: torch.Tensor | None = None
        self._last_step: int | None = None

    @staticmethod
    def _layers(pl_module):
        patch = getattr(pl_module, "patch", None)
        if patch is None:
            raise AttributeError("RoutingLogCallback needs the LightningModule to expose the MoEPatch as `self.patch`")
        return patch.layers

    def _totals(self, pl_module) -> torch.Tensor:
        return torch.cat([layer.total_counts.detach().reshape(-1) for layer in self._layers(pl_module)]).clone()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if without_moe_layers(self, pl_module):  # a dense model: no routing, no log file
            self._base = None
            return
        self._base = self._totals(pl_module)
        self._last_step = trainer.global_step
        if self.path is None:
            self.path = Path(trainer.default_root_dir) / LOG_FILE
        if trainer.is_global_zero:
            header = {"header": model_signature(pl_module.model, self.model_name, self._layers(pl_module))}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            mode = "a" if self.path.is_file() and self.path.stat().st_size else "w"
            if mode == "w":
                self.path.write_text(json.dumps(header) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._base is None or step == self._last_step or step % self.every_n_steps:
            return
        self._last_step = step
        now = self._totals(pl_module)
        delta = trainer.strategy.reduce((now - self._base.to(now.device)).clone(), reduce_op="sum")
        self._base = now
        if trainer.is_global_zero:
            sizes = [layer.num_experts for layer in self._layers(pl_module)]
            counts = [c.tolist() for c in torch.split(delta.detach().to("cpu", torch.long), sizes)]
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, "counts": counts}) + "\n")


def read_routing_log(path) -> tuple[dict, list[int], torch.Tensor]:
    """(header, steps, counts [steps, layers, experts]) of a routing log."""
    lines = Path(path).read_text().splitlines()
    if not lines or "header" not in json.loads(lines[0]):
        raise ValueError(f"{path} is not a routing log (no header line): record one with +callbacks=routing_log")
    header = json.loads(lines[0])["header"]
    rows = [json.loads(line) for line in lines[1:] if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no recorded step")
    return header, [r["step"] for r in rows], torch.tensor([r["counts"] for r in rows], dtype=torch.long)
