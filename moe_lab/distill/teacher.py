"""The frozen teacher: loading, and widened routing (top-k' experts, docs/specs/compression.md 2.9 / A2-7)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..moe.block import ConventionalRouting
from ..moe.routing import routing_probabilities, select_topk

# the top-k' expert weights of a widened teacher: ``family`` (the family's own weight rule on the k'-set, so k' = k
# is the teacher; renormalising routers renormalise over the k' experts) | ``paper_eq6`` (the paper's Eq. 6: p of
# every expert of the k'-set, p = softmax over ALL E logits, sigmoid affinity for sigmoid routers; no
# renormalisation, no routed scaling). ``raw`` is the earlier name of ``paper_eq6``.
WEIGHT_RULES = ("family", "paper_eq6")
WEIGHT_RULE_ALIASES = {"raw": "paper_eq6"}


def weight_rule_name(rule: str) -> str:
    """The canonical name of a widened teacher's weight rule (``raw`` -> ``paper_eq6``); others refused."""
    rule = WEIGHT_RULE_ALIASES.get(rule, rule)
    if rule not in WEIGHT_RULES:
        raise ValueError(f"method.options.teacher_weight_rule={rule!r}: choose family (the family's weight rule on "
                         "the k'-set) or paper_eq6 (alias raw: the paper's Eq. 6, p over all E experts)")
    return rule


def _conf_model_dir() -> Path:
    """``conf/model`` of the running Hydra app (its primary config source), else the repository's."""
    from hydra.core.hydra_config import HydraConfig

    sources = HydraConfig.get().runtime.config_sources if HydraConfig.initialized() else []
    for source in sources:
        if source.provider == "main" and source.schema == "file":
            return Path(source.path) / "model"
    return Path(__file__).resolve().parents[2] / "conf" / "model"


def teacher_spec(teacher: str | Path) -> dict:
    """A string ``method.teacher`` as a model spec: an existing checkpoint folder, a ``conf/model`` entry name
    (``tiny_qwen3_moe``), or a hub id (``org/name``); anything else is refused naming method.teacher."""
    from omegaconf import OmegaConf

    text = str(teacher)
    if Path(text).expanduser().exists():
        return {"pretrained": text, "tokenizer": text}
    entries = _conf_model_dir()
    if (entries / f"{text}.yaml").is_file():
        return OmegaConf.to_container(OmegaConf.load(entries / f"{text}.yaml"), resolve=True)
    if text.count("/") == 1 and not text.startswith((".", "~")):  # a hub id: load_model says how to go offline
        return {"pretrained": text, "tokenizer": text}
    names = sorted(p.stem for p in entries.glob("*.yaml"))
    raise FileNotFoundError(
        f"method.teacher={text}: neither a conf/model entry ({', '.join(names)}) nor an existing checkpoint "
        f"folder (working directory {Path.cwd()}); set method.teacher=<entry name> or =/path/to/export")


def load_teacher(teacher) -> nn.Module:
    """A frozen teacher in eval mode: a loaded module, a ``conf/model`` entry (a dict, or its name) or a checkpoint
    path. An MoE of moe-lab's families or a dense causal LM (dense -> dense KD): loaded as for ``method=kd``."""
    from ..core.plain import to_plain
    from ..models import load_model

    if isinstance(teacher, nn.Module):
        model = teacher
    elif teacher is None:
        raise ValueError("method.teacher is not set: give a model config (e.g. method.teacher=${model}) or a path")
    else:
        spec, named = to_plain(teacher), None
        if isinstance(spec, (str, Path)):
            named, spec = str(spec), teacher_spec(spec)
        try:
            model, _ = load_model(spec, dense=True)
        except OSError as err:
            if named is None:
                raise
            raise OSError(f"method.teacher={named}: {err} (for the teacher: method.teacher=/local/path)") from None
    model.eval()
    model.requires_grad_(False)
    return model


class WidenedRouting(ConventionalRouting):
    """The family's routing with the top-k' experts: ``family`` applies the family's weight rule to the k'-set
    (k' = k is the teacher exactly); ``paper_eq6`` (alias ``raw``) weights each of them by p, the routing
    probability over all E experts (``routing.routing_probabilities``), as the paper's Eq. 6 writes."""

    def __init__(self, view, top_k: int, weight_rule: str = "family"):
        super().__init__(view)
        self.top_k = int(top_k)
        self.weight_rule = weight_rule_name(weight_rule)

    def __call__(self, router: nn.Module, x: torch.Tensor):
        logits = self.logits(router, x)
        weights, indices = select_topk(self.rule, logits, router.training,
                                       self.view.correction_bias, top_k=self.top_k)
        if self.weight_rule == "paper_eq6":
            weights = routing_probabilities(self.rule, logits).gather(1, indices).to(weights.dtype)
        return logits, weights, indices


def widen_teacher(teacher: nn.Module, top_k: int, weight_rule: str = "family"):
    """Install moe-lab blocks in ``teacher`` routing every token to ``top_k`` experts; returns the patch."""
    from ..moe.block import MoEBlock
    from ..moe.patch import MoEPatch
    from ..moe.registry import supported_families

    if teacher.config.model_type not in supported_families():
        raise ValueError(f"method.options.teacher_top_k={top_k} widens an MoE teacher's routing, but the teacher is "
                         f"a dense {teacher.config.model_type!r} model: set method.options.teacher_top_k=null")
    weight_rule = weight_rule_name(weight_rule)
    if any(isinstance(m, MoEBlock) for m in teacher.modules()):
        raise ValueError("the teacher already has moe-lab blocks installed: widen a plain HF teacher")
    patch = MoEPatch(teacher, method="sft")  # plain routing blocks, which the widened policy then replaces
    for view, block in zip(patch.views, patch.layers):
        if not 1 <= int(top_k) <= view.num_experts:
            patch.remove()
            raise ValueError(f"method.options.teacher_top_k={top_k}: layer {view.index} has {view.num_experts} "
                             f"experts; choose 1 <= k' <= {view.num_experts}")
        view.router.moe_lab_policy = WidenedRouting(view, top_k, weight_rule)
        block.top_k = int(top_k)
    return patch
