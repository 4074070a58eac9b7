"""Down-projection correlation between condenser experts and regular experts (Condenser paper App. I, Fig. 4;
compression spec 4.6): Pearson correlation of centred ``vec(W_down)``, change against the base model."""

from __future__ import annotations

import torch
from torch import nn

from ..moe.view import find_moe_layers


def pearson(down: torch.Tensor) -> torch.Tensor:
    """[E, E] Pearson correlation (fp64) of the flattened, centred per-expert tensors ``down[e]``."""
    w = down.detach().reshape(down.shape[0], -1).to(torch.float64)
    w = w - w.mean(dim=1, keepdim=True)
    w = w / w.norm(dim=1, keepdim=True)
    return w @ w.T


def down_correlations(model: nn.Module) -> dict[int, torch.Tensor]:
    """``{MoE layer index: [E, E] Pearson matrix of its experts' down_proj}``."""
    return {v.index: pearson(v.down_proj) for v in find_moe_layers(model)}


def signature(model: nn.Module, label: str) -> dict:
    views = find_moe_layers(model)
    return {"label": label, "model_type": model.config.model_type,
            "layers": {v.index: tuple(v.down_proj.shape) for v in views}}


def check_same_architecture(base: dict, other: dict) -> None:
    """Refuse checkpoints of different architectures or expert counts, naming both."""
    if base["model_type"] != other["model_type"] or base["layers"] != other["layers"]:
        def describe(s):
            shapes = sorted(set(s["layers"].values()))
            return f"{s['label']} ({s['model_type']}, {len(s['layers'])} MoE layers, down_proj {shapes})"

        raise ValueError(f"correlation needs checkpoints of one architecture: {describe(base)} vs {describe(other)}")


def deltas(base: dict[int, torch.Tensor], tuned: dict[str, dict[int, torch.Tensor]],
           condensers: dict[int, list[int]]) -> tuple[list[dict], int]:
    """Rows (method, layer, condenser i, regular j, C_base, C, delta %) and the count of skipped pairs
    (C_base = 0, delta undefined). delta = 100 (C - C_base) / |C_base|."""
    rows, skipped = [], 0
    for layer, c0 in sorted(base.items()):
        shared = condensers.get(layer)
        if not shared:
            raise ValueError(f"task.condensers has no condenser experts for MoE layer {layer}")
        regular = [j for j in range(c0.shape[0]) if j not in shared]
        for method, mats in tuned.items():
            c = mats[layer]
            for i in shared:
                for j in regular:
                    if c0[i, j] == 0:
                        skipped += 1
                        continue
                    rows.append({"method": method, "layer": layer, "condenser": i, "expert": j,
                                 "c_base": float(c0[i, j]), "c": float(c[i, j]),
                                 "delta_pct": float(100 * (c[i, j] - c0[i, j]) / c0[i, j].abs())})
    return rows, skipped


def summarise(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Per-layer mean delta per method, and per method the mean and population std over layers."""
    import pandas as pd

    df = pd.DataFrame(rows)
    layer = df.groupby(["method", "layer"], sort=True)["delta_pct"].mean().reset_index()
    model = layer.groupby("method")["delta_pct"].agg(mean="mean", std=lambda x: x.std(ddof=0)).reset_index()
    return layer.to_dict("records"), model.to_dict("records")
