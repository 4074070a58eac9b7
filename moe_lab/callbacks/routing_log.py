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

from ..core.atomic import atomic_write_text
from ._dense import without_moe_layers
from ._windows import CountWindow

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
    previous recorded step, summed over data-parallel ranks; a collective, every rank calls it).

    A resumed run continues the log of the checkpoint's run: the file (that run's, when resumed into another
    directory) is rewritten with its header and the steps up to the checkpoint (a killed run's later steps are
    dropped), and the counts since the last recorded step travel in the checkpoint, so the log equals an
    uninterrupted run's."""

    def __init__(self, every_n_steps: int = 1, path: str | os.PathLike | None = None, model_name: str | None = None):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError("callbacks.routing_log.every_n_steps must be >= 1")
        self.every_n_steps = int(every_n_steps)
        self.path = None if path is None else Path(path)
        self.model_name = model_name
        self._window: CountWindow | None = None
        self._last_step: int | None = None
        self._restored: dict | None = None

    @staticmethod
    def _layers(pl_module):
        patch = getattr(pl_module, "patch", None)
        if patch is None:
            raise AttributeError("RoutingLogCallback needs the LightningModule to expose the MoEPatch as `self.patch`")
        return patch.layers

    def _totals(self, pl_module) -> torch.Tensor:
        return torch.cat([layer.total_counts.detach().reshape(-1) for layer in self._layers(pl_module)]).clone()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self._window is not None:  # a collective: every rank writes a checkpoint together
            checkpoint.setdefault("callbacks", {})[self.state_key] = {
                "path": str(self.path), "window": self._window.state(trainer, self._totals(pl_module))}

    def load_state_dict(self, state_dict: dict) -> None:
        self._restored = dict(state_dict) if state_dict else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored, self._restored = self._restored, None
        if without_moe_layers(self, pl_module):  # a dense model: no routing, no log file
            self._window = None
            return
        step, totals = trainer.global_step, self._totals(pl_module)
        self._window, self._last_step = CountWindow(), step
        if restored is None:
            self._window.open(totals, step)
        else:
            self._window.resume(totals, step, restored.get("window"), "RoutingLogCallback")
        if self.path is None:
            self.path = Path(trainer.default_root_dir) / LOG_FILE
        if trainer.is_global_zero:
            header = {"header": model_signature(pl_module.model, self.model_name, self._layers(pl_module))}
            earlier = Path(restored["path"]) if restored and restored.get("path") else self.path
            kept = _lines_up_to(earlier, step) if step else []
            if kept or not (self.path.is_file() and self.path.stat().st_size):
                atomic_write_text(self.path, "".join(line + "\n" for line in (kept or [json.dumps(header)])))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._window is None or step == self._last_step or step % self.every_n_steps:
            return
        self._last_step = step
        _, delta = self._window.close(trainer, self._totals(pl_module), step)
        if trainer.is_global_zero:
            sizes = [layer.num_experts for layer in self._layers(pl_module)]
            counts = [c.tolist() for c in torch.split(delta, sizes)]
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, "counts": counts}) + "\n")


def _lines_up_to(path: Path, step: int) -> list[str]:
    """The header and the recorded steps up to ``step`` of a routing log ([] when there is none); a line cut short
    by a kill is dropped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append((line, json.loads(line)))
        except json.JSONDecodeError:
            continue
    if not rows or "header" not in rows[0][1]:
        return []
    return [rows[0][0]] + [line for line, row in rows[1:] if row.get("step", step + 1) <= step]


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
