"""``moe_lab.apply``: install moe-lab blocks into a loaded HF MoE model, in place."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..core.atomic import explain_write_failure, publish_tree
from .block import ConventionalRouting, MoEBlock, routed_router_class
from .hf_init import install_hf_init, remove_hf_init
from .layout import leading_mask
from .registry import set_config_value
from .stats import TokenContext
from .view import MoELayerView, dense_layer_indices, find_moe_layers

_ATTENTION = re.compile(r"\.(?:self_attn|attn)\.")  # attention modules (DBRX: norm_attn_norm.attn)
PARAMETER_GROUPS = ("router", "experts", "shared_experts", "attention", "embeddings", "other")


class MoEPatch:
    """The moe-lab blocks installed in one model, with export/remove and routing statistics."""

    def __init__(self, model: nn.Module, method: str = "sft"):
        self.model = model
        self.method = method
        self.views: list[MoELayerView] = find_moe_layers(model)
        self.dense_layers = dense_layer_indices(model, self.views)
        self.context = TokenContext()
        self.layers: list[MoEBlock] = [MoEBlock(view, self.context) for view in self.views]
        for view in self.views:  # methods replace this policy in their installers
            view.router.moe_lab_policy = ConventionalRouting(view)
        self._hooks = []
        self._installed = False
        # expert tensors trained only on some expert slices: name -> (parameter, bool mask over its leading axis:
        # [E] for packed tensors, [E*I] for DBRX's row blocks; moe_lab.moe.layout.leading_mask)
        self.expert_slice_masks: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
        # callables run after every optimizer step (e.g. router-bias updates)
        self.step_hooks: list = []
        # callables ``hook(directory)`` writing method state beside an export (e.g. router biases)
        self.export_hooks: list = []
        # LoRA: returns the merged (vanilla-keyed) state dict for export; None saves the model as is
        self.export_state_dict = None
        # Expert Condenser's bias update (set by its installer); see :meth:`update_biases`
        self.bias_updater = None
        self.install()

    @property
    def spec(self):
        return self.views[0].spec

    # installation -------------------------------------------------------------------------
    def install(self) -> None:
        """Put the moe-lab blocks (and routing routers) in place of the HF blocks."""
        if self._installed:
            return
        for view, block in zip(self.views, self.layers):
            router = view.router
            router.__class__ = routed_router_class(type(router))
            _set_module(self.model, view.name, block)
            view.installed = block
        install_hf_init(self.model)
        self._hooks = [
            self.model.register_forward_pre_hook(self.context.capture, with_kwargs=True),
            self.model.register_forward_hook(self.context.release, with_kwargs=True),
        ]
        self._installed = True

    def remove(self) -> nn.Module:
        """Restore the vanilla HF modules (parameters are shared, so training is kept)."""
        if not self._installed:
            return self.model
        for view, block in zip(self.views, self.layers):
            view.block.train(block.training)
            view.installed = None
            _set_module(self.model, view.name, block.synced_hf_block())
            router = view.router
            router.__class__ = type(router).__mro__[1]
        remove_hf_init(self.model)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._installed = False
        return self.model

    @contextmanager
    def removed(self):
        """Temporarily restore the vanilla HF modules."""
        was_installed = self._installed
        self.remove()
        try:
            yield self.model
        finally:
            if was_installed:
                self.install()

    # statistics ---------------------------------------------------------------------------
    def reset_counts(self) -> None:
        """Zero every layer's ``counts``."""
        for layer in self.layers:
            layer.reset_counts()

    def counts(self) -> torch.Tensor:
        """int64 [num_moe_layers, num_experts] tokens routed since the last reset."""
        return torch.stack([layer.counts for layer in self.layers])

    def calibration(self):
        """Context manager: count routing statistics even in eval mode."""
        return self.context.calibration()

    # parameters ---------------------------------------------------------------------------
    def parameter_groups(self) -> dict[str, list[tuple[str, nn.Parameter]]]:
        """Trainable-or-not parameters by group: router, experts, shared_experts, attention, embeddings, other."""
        owner: dict[int, str] = {}
        for view in self.views:
            for p in view.router.parameters():
                owner[id(p)] = "router"
            for p in view.experts.parameters():
                owner[id(p)] = "experts"
            for module in (view.shared, view.shared_gate):
                if module is not None:
                    for p in module.parameters():
                        owner[id(p)] = "shared_experts"
        for module in (self.model.get_input_embeddings(), self.model.get_output_embeddings()):
            if module is not None:
                for p in module.parameters():
                    owner[id(p)] = "embeddings"
        groups: dict[str, list] = {g: [] for g in PARAMETER_GROUPS}
        seen = set()
        for name, p in self.model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            group = owner.get(id(p)) or ("attention" if _ATTENTION.search(f".{name}") else "other")
            groups[group].append((name, p))
        return groups

    def restrict_expert_training(self, experts: dict[int, list[int]]) -> None:
        """Train only ``experts[layer index]`` among each layer's routed experts (slices of the packed
        tensors; a layer not listed trains none). Gradients of the other slices are zeroed by hooks and
        :meth:`expert_slice_masks` tells the optimizer to decay only the trained slices, so the other
        slices stay bit-identical."""
        by_index = {view.index: view for view in self.views}
        unknown = sorted(set(experts) - set(by_index))
        if unknown:
            raise ValueError(f"experts: layers {unknown} are not MoE layers; MoE layers are {sorted(by_index)}")
        for view, block in zip(self.views, self.layers):
            ids = sorted({int(e) for e in experts.get(view.index, [])})
            bad = [e for e in ids if not 0 <= e < view.num_experts]
            if bad:
                raise ValueError(
                    f"experts[{view.index}]: expert ids {bad} out of range [0, {view.num_experts})"
                )
            mask = torch.zeros(view.num_experts, dtype=torch.bool)
            mask[ids] = True
            lo, hi = getattr(view.experts, "moe_lab_expert_range", (0, view.num_experts))  # EP: the local experts
            for pname, param in view.experts.named_parameters():
                if not ids:
                    param.requires_grad_(False)
                elif not bool(mask.all()):  # decided on every expert: each EP rank's tensors are masked alike
                    rows = leading_mask(mask[lo:hi], param)  # DBRX: expert e owns I rows of each [E*I, H] tensor
                    self.expert_slice_masks[f"{view.name}.experts.{pname}"] = (param, rows)
                    block.hook_gradient_slices(param, rows)

    def update_biases(self) -> None:
        """Expert Condenser: one router-bias update from the loads since the previous update (all-reduced
        across data-parallel ranks), then reset the loads. Call once per optimizer step."""
        if self.bias_updater is None:
            raise RuntimeError(f"method {self.method!r} has no router biases: use moe_lab.apply(model, 'condenser')")
        self.bias_updater()

    def after_optimizer_step(self) -> None:
        """Run the registered per-step hooks (call once per optimizer step, after accumulation)."""
        for hook in self.step_hooks:
            hook()

    # aux loss -----------------------------------------------------------------------------
    def set_aux_loss_coef(self, coef: float) -> bool:
        """Map ``coef`` onto the family's aux-loss field; True if HF adds it to the loss itself.

        Families without an HF aux loss (registry ``aux_loss`` other than "hf", e.g. DeepSeek) return False:
        the caller adds :func:`moe_lab.moe.aux_loss.added_aux_loss` once, so nothing is counted twice.
        """
        field = self.spec.aux_loss_field
        if not hasattr(self, "_exported_output_router_logits"):
            self._exported_output_router_logits = getattr(self.model.config, "output_router_logits", False)
        self.model.config.output_router_logits = coef > 0
        if field is None or self.spec.aux_loss != "hf":
            return False
        set_config_value(self.model.config, field, coef)
        attr = self.spec.aux_loss_model_attr or field
        if hasattr(self.model, attr):
            setattr(self.model, attr, coef)
        return True

    # export -------------------------------------------------------------------------------
    def export(self, path: str | os.PathLike, tokenizer=None, safe_serialization: bool = True) -> Path:
        """Write a checkpoint vanilla ``AutoModelForCausalLM.from_pretrained`` loads, atomically."""
        def write(tmp: Path) -> None:
            with self.removed(), self._exported_config():
                state_dict = self.export_state_dict() if self.export_state_dict else None
                self.model.save_pretrained(tmp, safe_serialization=safe_serialization, state_dict=state_dict)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)

        return atomic_export(path, write, self.export_hooks)

    @contextmanager
    def _exported_config(self):
        """The model's own ``output_router_logits`` while saving: the training aux-loss switch is not part of
        the checkpoint (with it, HF computes a batch-shaped aux loss during cached generation and fails)."""
        config = self.model.config
        training_value = getattr(config, "output_router_logits", None)
        if hasattr(self, "_exported_output_router_logits"):
            config.output_router_logits = self._exported_output_router_logits
        try:
            yield
        finally:
            if training_value is not None:
                config.output_router_logits = training_value

    def __repr__(self) -> str:
        return (
            f"MoEPatch(family={self.spec.model_type}, method={self.method}, moe_layers="
            f"{[layer.index for layer in self.layers]}, dense_layers={self.dense_layers})"
        )


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def atomic_export(path: str | os.PathLike, write, hooks=()) -> Path:
    """``write(tmp)``, then each of ``hooks(tmp)``, on a temporary folder beside ``path``, which (fsynced, with the
    umask's mode rather than ``mkdtemp``'s 0700) replaces ``path`` only once all of them finished (a failure leaves
    ``path`` as it was and removes the temporary folder). The one writer of every model export."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        with explain_write_failure(path):
            write(tmp)
            for hook in hooks:
                hook(tmp)
            publish_tree(tmp)
        _atomic_replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _atomic_replace_dir(src: Path, dst: Path) -> None:
    """Move directory ``src`` to ``dst``; an existing ``dst`` is replaced only once ``src`` is complete."""
    if dst.exists():
        backup = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(backup, ignore_errors=True)
        os.replace(dst, backup)
        os.replace(src, dst)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(src, dst)
