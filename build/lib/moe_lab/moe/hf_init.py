"""transformers' weight initialisation of a patched model: a moe-lab block is initialised as the HF block it replaced.

Every entry point (``init_weights``, ``initialize_weights``, ``from_pretrained``'s missing keys,
``model.apply(model._init_weights)``) initialises a module with its PreTrainedModel's ``_init_weights(module)``, which
dispatches on transformers' own classes: HY-V3 zeroes its block's ``e_score_correction_bias``, Qwen3-Next draws its
block's ``gate.weight``, and a :class:`~moe_lab.moe.block.MoEBlock` matches none of them. While installed, each
PreTrainedModel of the model initialises through :class:`HFBlockInit` (its instance ``_init_weights``), which passes
its class's ``_init_weights`` the HF block, holding the moe-lab block's tensors, in place of the moe-lab block.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from .block import MoEBlock


class HFBlockInit:
    """A patched PreTrainedModel's ``_init_weights``: its class's, given the HF block in place of a moe-lab block
    (at the same point of transformers' module walk, so the random draws are vanilla's)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def __call__(self, module: nn.Module) -> None:
        if isinstance(module, MoEBlock):
            module = module.synced_hf_block()
        type(self.model)._init_weights(self.model, module)


def install_hf_init(model: nn.Module) -> None:
    """Initialise ``model``'s moe-lab blocks as their HF blocks (every PreTrainedModel in it, sub-models included:
    each initialises its own modules)."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module._init_weights = HFBlockInit(module)


def remove_hf_init(model: nn.Module) -> None:
    """Undo :func:`install_hf_init`: every PreTrainedModel's ``_init_weights`` is its class's again."""
    for module in model.modules():
        if isinstance(vars(module).get("_init_weights"), HFBlockInit):
            del module._init_weights
