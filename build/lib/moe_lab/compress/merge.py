"""Score-weighted parameter merging of expert groups and down-projection scaling (spec 2.6-2.7).

Pure functions on the packed expert tensors (``{name: tensor [E, ...]}`` as ``MoELayerView.expert_parameters``
returns them; GPT-OSS biases included) and on per-expert scores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

SCALINGS = ("uniform", "proportional", "conditional")


def merge_coefficients(scores: torch.Tensor, group: Sequence[int]) -> torch.Tensor:
    """fp64 weights ``s_e / S_g`` of the group's members; uniform ``1/|g|`` when ``S_g = 0``."""
    s = scores.detach().double().cpu()[list(group)]
    if (s < 0).any():
        raise ValueError(f"merge weights need non-negative scores, got {s.tolist()} for experts {list(group)}")
    total = s.sum()
    return s / total if total > 0 else torch.full_like(s, 1.0 / len(group))


def merge_group(
    params: Mapping[str, torch.Tensor], group: Sequence[int], coefficients: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One representative expert ``sum_e c_e W^(e)`` for every packed tensor (accumulated in fp64, returned
    in the parameter dtype); a singleton group is an exact copy."""
    group = [int(e) for e in group]
    if len(coefficients) != len(group):
        raise ValueError(f"{len(coefficients)} merge coefficients for a group of {len(group)} experts")
    out = {}
    for name, p in params.items():
        if len(group) == 1:
            out[name] = p[group[0]].detach().clone()
            continue
        c = coefficients.to(device=p.device, dtype=torch.float64)
        merged = torch.tensordot(c, p.detach()[group].double(), dims=1)
        out[name] = merged.to(p.dtype)
    return out


def check_scaling(method: str, normalises_topk: bool, routed_scaling: float = 1.0) -> None:
    """Refuse ``conditional`` scaling for a router whose top-k weights are renormalised (spec 2.7: the paper
    uses it only for DeepSeek-V2-Lite, which does not renormalise): CP averages the probability p before
    renormalisation, while such a router applies p / sum_topk p (x routed_scaling), so routed_scaling x mean CP
    is not the mass it routes (DeepSeek-V3: about 9 against 2.5)."""
    if method not in SCALINGS:
        raise ValueError(f"compress.scaling={method!r}: choose one of {', '.join(SCALINGS)}")
    if method == "conditional" and normalises_topk:
        raise ValueError(
            "compress.scaling=conditional is for routers that do not renormalise their top-k weights (the paper's "
            "DeepSeek-V2-Lite): this router renormalises them to sum to routed_scaling_factor="
            f"{routed_scaling:g}, so the mean conditional probability (taken before renormalisation) is not the "
            "weight it applies; use compress.scaling=uniform or proportional (both scaled to sum to "
            f"{routed_scaling:g})")


def scaling_coefficients(
    method: str,
    groups: Sequence[Sequence[int]],
    scores: torch.Tensor,
    k: int,
    cp: torch.Tensor | None = None,
    routed_scaling: float = 1.0,
) -> torch.Tensor:
    """fp64 down-projection scales alpha_g per group (spec 2.7).

    uniform: routed_scaling / k. proportional: routed_scaling * S_g / sum of the scores of all selected experts
    (uniform when that sum is 0). Both sum to routed_scaling, the routed mass of a renormalising router (1 for
    Qwen3 / GPT-OSS, as the paper; 2.5 for DeepSeek-V3). conditional: routed_scaling * mean CP of the group's
    members (for families that do not renormalise).
    """
    scale = float(routed_scaling)
    if method == "uniform":
        return torch.full((len(groups),), scale / k, dtype=torch.float64)
    if method == "proportional":
        s = scores.detach().double().cpu()
        mass = torch.stack([s[list(g)].sum() for g in groups])
        total = mass.sum()
        return scale * (mass / total if total > 0 else torch.full_like(mass, 1.0 / len(groups)))
    if method == "conditional":
        if cp is None:
            raise ValueError("compress.scaling=conditional needs the CP score (count and p_sel statistics)")
        c = cp.detach().double().cpu()
        return torch.stack([c[list(g)].mean() for g in groups]) * float(routed_scaling)
    raise ValueError(f"compress.scaling={method!r}: choose one of {', '.join(SCALINGS)}")
