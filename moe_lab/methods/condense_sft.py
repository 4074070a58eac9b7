"""Lightweight SFT of a CD-MoE model (docs/specs/compression.md 3.8): only the retained experts of the condensed
layers train (their packed slices + the shared expert; its Qwen2-MoE sigmoid gate too); routers, fixed
gates, attention, embeddings, norms and every other layer stay frozen.

``method=condense_sft method.options.condensed=<task=condense run>/export``: the condensed model is loaded from
that export (``load_condensed``) in place of ``cfg.model``'s weights (``model=`` must name the same base
model: its tokenizer is used); the non-condensed MoE layers are patched as for ``method=sft``. The export
after training is the same format (``load_condensed`` reads it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..compress.condense import CONDENSE_FILE, CondensedLayer, load_condensed, write_condensed
from ..core.precision import load_dtype
from .base import MoELightningModule


def condensed_trainable(model: torch.nn.Module) -> list[str]:
    """Freeze everything but the parameters of the model's :class:`CondensedLayer` modules; their names."""
    keep = {id(p) for m in model.modules() if isinstance(m, CondensedLayer) for p in m.parameters()}
    if not keep:
        raise ValueError("method=condense_sft: the model has no condensed layer (method.options.condensed must be "
                         "a task=condense export directory)")
    names = []
    for name, p in model.named_parameters():
        p.requires_grad_(id(p) in keep)
        if id(p) in keep:
            names.append(name)
    return names


LOSS_TOKENS = ("response", "all")


class CondenseSFTModule(MoELightningModule):
    """:class:`MoELightningModule` on the condensed model of ``options.condensed``, condensed experts only."""

    export_manifest = CONDENSE_FILE  # the condensed format (``_rewrite_export``): its weights need the manifest

    def __init__(self, model: torch.nn.Module, options: dict | None = None, **kwargs):
        options = dict(options or {})
        path = options.pop("condensed", None)
        loss_tokens = options.pop("loss_tokens", "response")
        if loss_tokens not in LOSS_TOKENS:
            raise ValueError(f"method.options.loss_tokens={loss_tokens!r}: choose response (the dataset's labels) or "
                             "all ([CD-code]: labels = input_ids, prompt and padding included)")
        if not path:
            raise ValueError("method=condense_sft needs method.options.condensed=<task=condense run>/export")
        base = model.config.model_type
        # the base weights are replaced (and released); model.dtype stays the load dtype (exports are written in it)
        condensed = model = load_condensed(path, dtype=load_dtype(model))
        if condensed.config.model_type != base:
            raise ValueError(f"method.options.condensed={path} is a {condensed.config.model_type} model but "
                             f"model= is {base}: pass the base model the export was condensed from")
        kwargs.setdefault("method", "sft")
        super().__init__(condensed, options=options, **kwargs)
        self.trainable_names = condensed_trainable(condensed)
        self.patch.export_hooks.append(lambda directory: _rewrite_export(condensed, directory, path))
        self.loss_tokens = loss_tokens
        self.hparams["options"] = {"condensed": str(path), "loss_tokens": loss_tokens, **options}

    def _step(self, batch, stage: str):
        """``loss_tokens=all``: the loss on every position, prompt and padding included ([CD-code])."""
        if self.loss_tokens == "all":
            if "position_ids" in batch:
                raise ValueError("method.options.loss_tokens=all trains on padding, which packed rows do not "
                                 "have: set dataset.packing=false")
            batch = {**batch, "labels": batch["input_ids"].clone()}
        return super()._step(batch, stage)


def _rewrite_export(model: torch.nn.Module, directory, source) -> None:
    """Replace save_pretrained's weights (HF converts packed experts to its hub layout on save, which the
    condensed layers do not have) by :func:`~moe_lab.compress.condense.export_condensed`'s single file + manifest
    (``directory`` is the export's temporary folder: the whole export is published atomically); the manifest keeps the
    source export's provenance (search knobs, calibration) and names the source as ``condensed_from``. Written
    from the live model in its load dtype (fp32 master weights cast back once, as the save_pretrained export)."""
    for file in [*Path(directory).glob("*.safetensors"), *Path(directory).glob("*.safetensors.index.json")]:
        file.unlink()
    before = json.loads((Path(source) / CONDENSE_FILE).read_text())
    extra = {k: v for k, v in before.items() if k not in ("method", "dtype", "layers")}
    write_condensed(model, directory, extra={**extra, "condensed_from": str(source)})
