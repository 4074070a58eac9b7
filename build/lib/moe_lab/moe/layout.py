"""How a family stores its routed experts' tensors, and per-expert VIEWS of them (never copies).

Every layout's tensors have the expert as their leading axis in equal blocks: packed [E, ...] tensors (one block
per index) or DBRX's [E*I, H] rows (expert e owns rows e*I .. (e+1)*I-1). So a per-expert mask over E acts on a
tensor's leading axis in blocks of ``shape[0] // E`` (:func:`leading_mask`), and ``tensors`` reshapes each
stored parameter into an [E, ...] view whose slices are the real weights: gradients, in-place edits, masks and
exports reach the model.

Roles (``gate`` [E, I, H], ``up`` [E, I, H], ``down`` [E, H, I]) name the SwiGLU factors in every layout as views
too, for computations that need them (per-expert forwards, weight statistics). Packed layouts differ in three
flags: ``transposed`` (stored [E, in, out], applied as x @ W: GPT-OSS, Llama 4, Aria), ``interleaved`` (gate /
up columns alternate: GPT-OSS; else gate rows / columns, then up) and ``biases`` (GPT-OSS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize


@dataclass(frozen=True)
class ExpertLayout:
    """One storage layout of a family's routed experts (registry ``expert_layout``).

    owner: the submodule of the experts module holding the tensors ("" = the experts module itself).
    packed: the tensors are 3-D [E, ...] (HF's grouped / batched kernels and moe-lab's grouped paths read
    ``gate_up_proj`` / ``down_proj``); False: per-expert blocks of rows of 2-D tensors.
    names: the weight tensors (biases excluded), in their module's order.
    act: the activation's attribute in the owner module.
    down: the tensors on the output side of the experts (down projection, its bias): what scales an expert's output.
    transposed: packed tensors stored [E, in, out] and applied as x @ W (else [E, out, in], F.linear).
    interleaved: gate / up alternate along the packed gate_up tensor's intermediate axis (else gate, then up).
    biases: the packed tensors have ``<name>_bias`` companions.
    """

    name: str
    owner: str
    packed: bool
    names: tuple[str, ...]
    act: str = "act_fn"
    down: tuple[str, ...] = ("down_proj", "down_proj_bias")
    transposed: bool = False
    interleaved: bool = False
    biases: bool = False

    def module(self, experts: nn.Module) -> nn.Module:
        """The module that owns the expert tensors (where LoRA parametrizations and hooks go)."""
        return experts.get_submodule(self.owner) if self.owner else experts

    def activation(self, experts: nn.Module):
        """The experts' gate activation (act(gate) * up)."""
        return getattr(self.module(experts), self.act)

    def tensors(self, experts: nn.Module, num_experts: int) -> dict[str, torch.Tensor]:
        """Every expert tensor (biases included) as an [E, ...] view of its parameter, by attribute name; a
        parametrized one (LoRA) as the module computes it (base + adapter)."""
        module = self.module(experts)
        names = [name for name, _ in module.named_parameters(recurse=False)]
        if parametrize.is_parametrized(module):
            names += [name for name in module.parametrizations if name not in names]
        out = {}
        for name in names:
            tensor = getattr(module, name)
            out[name] = tensor if self.packed else tensor.view(num_experts, -1, *tensor.shape[1:])
        return out

    def roles(self, experts: nn.Module, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [E, I, H], up [E, I, H], down [E, H, I])`` views of the SwiGLU factors."""
        t = self.tensors(experts, num_experts)
        if not self.packed:  # DBRX: gate rows w1, up rows v1, down rows w2 (applied as h @ w2_e)
            return t["w1"], t["v1"], t["w2"].transpose(1, 2)
        gate_up, down = t["gate_up_proj"], t["down_proj"]
        if self.transposed:  # [E, H, 2I] and [E, I, H] as [E, 2I, H] and [E, H, I]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        gate, up = (gate_up[:, ::2], gate_up[:, 1::2]) if self.interleaved else gate_up.chunk(2, dim=1)
        return gate, up, down

    def project(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x`` [n, in] through one expert's packed ``weight`` slice, as the layout applies it."""
        return x @ weight if self.transposed else F.linear(x, weight)

    def split(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate, up)`` of a packed gate_up projection's output [n, 2I]."""
        return (gate_up[..., ::2], gate_up[..., 1::2]) if self.interleaved else gate_up.chunk(2, dim=-1)


LAYOUTS: dict[str, ExpertLayout] = {
    "gate_up": ExpertLayout("gate_up", "", True, ("gate_up_proj", "down_proj")),
    "gpt_oss": ExpertLayout("gpt_oss", "", True, ("gate_up_proj", "down_proj"), transposed=True, interleaved=True,
                            biases=True),
    "transposed": ExpertLayout("transposed", "", True, ("gate_up_proj", "down_proj"), transposed=True),
    "w1_v1_w2": ExpertLayout("w1_v1_w2", "mlp", False, ("w1", "v1", "w2"), act="activation_fn", down=("w2",)),
}


def leading_mask(mask: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``mask`` [E] over experts as a bool mask over ``tensor``'s leading axis (E equal blocks of rows: the mask
    itself for packed [E, ...] tensors, each entry repeated I times for DBRX's [E*I, H])."""
    blocks, rest = divmod(tensor.shape[0], mask.numel())
    if rest or not blocks:
        raise ValueError(f"a per-expert mask over {mask.numel()} experts does not tile a tensor of leading size "
                         f"{tensor.shape[0]}")
    return mask.repeat_interleave(blocks) if blocks > 1 else mask


def expert_mask(rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The per-expert mask [E] that :func:`leading_mask` expanded into ``rows``."""
    return rows.view(num_experts, -1)[:, 0]
