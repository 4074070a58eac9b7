"""The frozen teacher: loading, and widened routing (top-k' experts, spec compression.md 2.9 / A2-7)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..moe.block import ConventionalRouting
from ..moe.routing import scores_from_logits, select_topk

WEIGHT_RULES = ("family", "raw")


def load_teacher(teacher) -> nn.Module:
    """A frozen teacher in eval mode: a loaded module, a ``conf/model`` entry (dict) or a checkpoint path.
    An MoE of moe-lab's families or a dense causal LM (dense -> dense KD): loaded as for ``method=kd``."""
    from ..models import load_model
    from ..plain import to_plain

    if isinstance(teacher, nn.Module):
        model = teacher
    elif teacher is None:
        raise ValueError("method.teacher is not set: give a model config (e.g. method.teacher=${model}) or a path")
    else:
        spec = to_plain(teacher)
        if isinstance(spec, (str, Path)):
            spec = {"pretrained": str(spec), "tokenizer": str(spec)}
        model, _ = load_model(spec, method="kd")
    model.eval()
    model.requires_grad_(False)
    return model


class WidenedRouting(ConventionalRouting):
    """The family's routing with the top-k' experts: ``family`` applies the family's weight rule to the k'-set
    (k' = k is the teacher exactly); ``raw`` uses the raw scores p of the k'-set (the paper's Eq. 6)."""

    def __init__(self, view, top_k: int, weight_rule: str = "family"):
        super().__init__(view)
        self.top_k = int(top_k)
        self.weight_rule = weight_rule

    def __call__(self, router: nn.Module, x: torch.Tensor):
        logits = self.logits(router, x)
        weights, indices = select_topk(self.rule, logits, router.training,
                                       self.view.correction_bias, top_k=self.top_k)
        if self.weight_rule == "raw":
            weights = scores_from_logits(self.rule, logits).gather(1, indices).to(weights.dtype)
        return logits, weights, indices


def widen_teacher(teacher: nn.Module, top_k: int, weight_rule: str = "family"):
    """Install moe-lab blocks in ``teacher`` routing every token to ``top_k`` experts; returns the patch."""
    from ..methods.registry import apply
    from ..moe.registry import supported_families

    if teacher.config.model_type not in supported_families():
        raise ValueError(f"method.options.teacher_top_k={top_k} widens an MoE teacher's routing, but the teacher is "
                         f"a dense {teacher.config.model_type!r} model: set method.options.teacher_top_k=null")
    if weight_rule not in WEIGHT_RULES:
        raise ValueError(f"method.options.teacher_weight_rule={weight_rule!r}: choose family or raw")
    patch = apply(teacher, "sft")
    for view, block in zip(patch.views, patch.layers):
        if not 1 <= int(top_k) <= view.num_experts:
            patch.remove()
            raise ValueError(f"method.options.teacher_top_k={top_k}: layer {view.index} has {view.num_experts} "
                             f"experts; choose 1 <= k' <= {view.num_experts}")
        view.router.moe_lab_policy = WidenedRouting(view, top_k, weight_rule)
        block.top_k = int(top_k)
    return patch
