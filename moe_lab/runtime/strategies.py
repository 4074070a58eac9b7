"""Distributed strategies (``hardware=gpu_ddp | deepspeed_zero2 | deepspeed_zero3 | deepspeed_zero3_offload |
fsdp``): build the strategy from the hardware config, check the devices, prepare the model for it (ZeRO-3 leaf
modules, FSDP wrapping and fp32 master weights, fp32 routing buffers) and refuse what cannot run under it.

Weights load before the strategy exists (``moe_lab.models.load_model``, full tensors on every rank, no
``HfDeepSpeedConfig`` alive, so ``from_pretrained`` never sees ZeRO-3's size-0 placeholders); DeepSpeed
partitions them in ``deepspeed.initialize`` and FSDP when it wraps the model.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision

from .optimizer_masters import refuse_optimizer_masters

log = logging.getLogger(__name__)

# what runs a method whose backward needs every expert's full weights (DenseMixer)


def strategy_kind(strategy) -> str:
    """``single`` | ``ddp`` | ``deepspeed_zero{1,2,3}`` | ``fsdp`` for a strategy object."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    if isinstance(strategy, DeepSpeedStrategy):
        return f"deepspeed_zero{zero_stage(strategy)}"
    if isinstance(strategy, FSDPStrategy):
        return "fsdp"
    if isinstance(strategy, DDPStrategy):
        return "ddp"
    return "single"


def model_forward(trainer, pl_module):
    """The callable that runs the LightningModule's HF model outside its training step (probes, forward-only
    passes): the strategy's FSDP root wrapper under FSDP (whose forward is ``pl_module.forward``: a nested FSDP
    unit called first takes itself for the root and the next training step fails), else ``pl_module.model``."""
    if trainer is not None and strategy_kind(trainer.strategy) == "fsdp":
        return trainer.strategy.model
    return pl_module.model


def zero_stage(strategy) -> int:
    """The ZeRO stage of a DeepSpeed strategy (0 when not DeepSpeed)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if not isinstance(strategy, DeepSpeedStrategy):
        return 0
    return int(strategy.config.get("zero_optimization", {}).get("stage", 0))


def config_strategy_kind(trainer_cfg) -> str:
    """:func:`strategy_kind` of a ``hardware.trainer`` config, without building anything (for resume checks)."""
    node = trainer_cfg.get("strategy", "auto")
    devices = trainer_cfg.get("devices", 1)
    if hasattr(node, "get") and node.get("_target_"):
        target = str(node["_target_"]).rsplit(".", 1)[-1]
        if target == "DeepSpeedStrategy":
            return f"deepspeed_zero{int(node.get('stage', 2))}"
        return {"FSDPStrategy": "fsdp", "DDPStrategy": "ddp"}.get(target, "single")
    node = str(node)
    if node.startswith("deepspeed"):
        return f"deepspeed_zero{node.split('_')[-1] if node[-1].isdigit() else 2}"
    if node.startswith(("fsdp", "ddp")):
        return node[:4].rstrip("_")
    return "ddp" if devices not in (1, "1") else "single"


def check_devices(trainer_kwargs: dict) -> None:
    """Refuse ``trainer.devices`` above what this machine has, naming the field, what exists and the fix."""
    devices, accelerator = trainer_kwargs.get("devices", "auto"), str(trainer_kwargs.get("accelerator", "auto"))
    if isinstance(devices, str):
        if not devices.isdigit():
            return  # "auto", "-1", "0,1": Lightning resolves and checks them
        devices = int(devices)
    if not isinstance(devices, int) or devices < 1:
        return
    if accelerator in ("gpu", "cuda"):
        available = torch.cuda.device_count()
        if devices > available:
            raise ValueError(
                f"trainer.devices={devices} (trainer.accelerator={accelerator}): this machine has {available} "
                f"CUDA GPU{'s' * (available != 1)}. Use trainer.devices={available} or fewer"
                + ("" if available else ", or hardware=cpu (hardware=ddp_cpu for 2 CPU processes)"))
    elif accelerator == "cpu":
        available = os.cpu_count() or 1
        if devices > available:
            raise ValueError(f"trainer.devices={devices} (trainer.accelerator=cpu): this machine has {available} "
                             f"CPU cores. Use hardware=cpu (one process) or trainer.devices<={available}")


def build_strategy(trainer_kwargs: dict):
    """Pop ``strategy`` from the merged trainer settings, check the devices and build it (hydra instantiate).

    A DeepSpeed strategy also takes ``precision`` (popped) as its :class:`AccumulateOnceDeepSpeedPrecision`."""
    check_devices(trainer_kwargs)
    strategy = trainer_kwargs.pop("strategy", "auto")
    if isinstance(strategy, dict):
        strategy = instantiate(strategy)
    _allow_torch_optimizer_offload(strategy)
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(strategy, DeepSpeedStrategy) and strategy._precision_plugin is None:
        strategy.precision_plugin = AccumulateOnceDeepSpeedPrecision(trainer_kwargs.pop("precision", "32-true"))
    return strategy


class AccumulateOnceDeepSpeedPrecision(DeepSpeedPrecision):
    """Lightning's DeepSpeed precision plugin, minus a second division of the loss by the accumulation steps.

    Lightning's automatic optimisation already divides ``training_step``'s loss by ``accumulate_grad_batches``
    (``ClosureResult.from_training_step_output``) and writes the same number into DeepSpeed's
    ``gradient_accumulation_steps``; ``DeepSpeedPrecision.backward`` then calls ``engine.backward(loss)``, whose
    default ``scale_wrt_gas=True`` divides again, so every Lightning + DeepSpeed run with A > 1 micro-batches
    would train on gradients A times too small (the bug transformers fixed in PR 35808). Here the engine is
    told not to scale, so gradients are the mean over the window, as under DDP."""

    def backward(self, tensor, model, optimizer, *args, **kwargs):
        kwargs.setdefault("scale_wrt_gas", False)
        super().backward(tensor, model, optimizer, *args, **kwargs)


def _allow_torch_optimizer_offload(strategy) -> None:
    """ZeRO-Offload refuses a torch optimizer unless told; moe-lab's modules build torch AdamW (its step then runs
    on the CPU, slower than DeepSpeedCPUAdam but with the same update)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(strategy, DeepSpeedStrategy):
        offload = strategy.config.get("zero_optimization", {}).get("offload_optimizer")
        if offload and offload.get("device", "none") != "none":
            strategy.config.setdefault("zero_force_ds_cpu_optimizer", False)


def z3_leaf_classes(model: torch.nn.Module) -> list[type]:
    """The MoE block classes DeepSpeed ZeRO-3 must treat as leaves: the family's HF block
    (``FamilySpec.block_class``, resolved in the model's modeling module) and moe-lab's ``MoEBlock`` that replaces
    it while a method is installed."""
    from ..moe.block import MoEBlock
    from ..moe.registry import family_spec

    spec = family_spec(model.config.model_type)
    hf_block = getattr(sys.modules[type(model).__module__], spec.block_class, None)
    if hf_block is None:
        raise ValueError(f"registry: {spec.block_class} is not defined in {type(model).__module__}")
    return [hf_block, MoEBlock]


def set_z3_leaf_modules(module) -> list[torch.nn.Module]:
    """Mark every MoE block of ``module`` (a MoELightningModule or an HF model) as a ZeRO-3 leaf, also the HF
    blocks held aside by an installed patch (they come back on export). Returns the marked modules in the tree."""
    from deepspeed.utils import set_z3_leaf_modules as mark
    from deepspeed.utils.z3_leaf_module import set_z3_leaf_module

    model = getattr(module, "model", module)
    marked = mark(model, z3_leaf_classes(model))
    for view in getattr(getattr(module, "patch", None), "views", ()):
        set_z3_leaf_module(view.block, True)
    return marked


def _refuse(module, strategy) -> None:
    precision = getattr(getattr(strategy, "precision_plugin", None), "precision", None)
    refuse_unsupported(module, strategy_kind(strategy), precision)


def trains_expert_slices(module) -> bool:
    """ESFT trains slices of packed expert tensors: installed already, or chosen at fit start (an ESFT module
    whose selection is still to be scored; the plan and the run refuse it before that pass)."""
    patch = getattr(module, "patch", None)
    pending = hasattr(module, "esft_config") and getattr(module, "selection", None) is None
    return bool(patch is not None and patch.expert_slice_masks) or pending


def refuse_unsupported(module, kind: str, precision: str | None = None) -> None:
    """Refuse a method that cannot run under the strategy ``kind`` (:func:`strategy_kind`) at ``precision``
    (Lightning's name, e.g. ``bf16-mixed``; also used by ``plan=true`` on a module built on the meta device)."""
    patch = getattr(module, "patch", None)
    if patch is None:
        return
    method = module.hparams.get("name") or module.hparams.get("method")
    slices = trains_expert_slices(module)
    if getattr(module, "master_weights", None) == "optimizer":
        refuse_optimizer_masters(method, kind, precision, slices)
    if kind.startswith("deepspeed") and slices and module.optim.get("weight_decay") \
            and str(precision or "").startswith("16"):
        raise ValueError(f"method={method} under hardware={kind} with precision={precision}: the trained expert "
                         "slices are decayed on ZeRO's fp32 masters before each step, and fp16's loss scaler may "
                         "then skip that step (an overflow), decaying them without one. Use bf16-mixed, "
                         "task.optim.weight_decay=0, or hardware=gpu_ddp")
    if kind not in ("deepspeed_zero3", "fsdp"):
        return
    where = f"method={method} under hardware={kind if kind == 'fsdp' else 'deepspeed_zero3'} ({kind})"
    if kind == "fsdp":
        from torch.nn.utils import parametrize

        if any(parametrize.is_parametrized(view.expert_module) for view in patch.views):
            raise ValueError(f"{where}: LoRA on packed experts is a torch parametrization, which FSDP's flat "
                             "parameters do not support: use hardware=deepspeed_zero3, deepspeed_zero2 or gpu_ddp, "
                             "or method.lora.targets without experts")
        if slices:
            raise ValueError(f"{where}: training only some expert slices (ESFT) masks gradients of whole packed "
                             "tensors, which FSDP flattens and shards: use hardware=gpu_ddp or deepspeed_zero2/3")


def prepare(trainer, module, ep_size: int = 1, ep_dense: str = "ddp") -> None:
    """Before ``trainer.fit``: refuse unsupported method x strategy pairs, mark ZeRO-3 leaf modules, set FSDP's
    wrapping (one unit per decoder layer) and fp32 master weights, keep routing buffers in fp32, and install
    expert parallelism (``ep_size > 1``, :class:`~.expert_parallel.ExpertParallelHooks`; ``ep_dense``: its dense
    part's optimizer state sharded, ``zero1``, or whole, ``ddp``)."""
    strategy = trainer.strategy
    kind = strategy_kind(strategy)
    if ep_size > 1:
        from .expert_parallel import ExpertParallelHooks

        trainer.callbacks.append(ExpertParallelHooks(ep_size, ep_dense))
    if kind in ("single", "ddp") or not hasattr(getattr(module, "model", None), "config"):
        return
    _refuse(module, strategy)
    if kind == "deepspeed_zero3":
        set_z3_leaf_modules(module)
    if kind == "fsdp":
        _prepare_fsdp(strategy, module.model)
    trainer.callbacks.append(KeepFp32Buffers())


def _prepare_fsdp(strategy, model) -> None:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if strategy.kwargs.get("auto_wrap_policy") is None:
        names = set(getattr(model, "_no_split_modules", None) or ())
        classes = {type(m) for m in model.modules() if type(m).__name__ in names}
        if classes:
            strategy.kwargs["auto_wrap_policy"] = ModuleWrapPolicy(classes)
    half = [p for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    if half:  # one FSDP flat parameter holds one dtype; fp32 shards are the master weights
        with torch.no_grad():
            for p in half:
                p.data = p.data.float()
        log.info("fsdp: %d half-precision parameter tensors upcast to fp32 (sharded master weights; "
                 "MixedPrecision computes in bf16)", len(half))


class KeepFp32Buffers(Callback):
    """DeepSpeed's bf16 engine casts every floating buffer of the model to bf16; routing biases and statistics
    stay fp32 (docs/design.md "Precision"): the fp32 buffers are copied before the strategy sets up and put back, with
    their exact values, where it cast them."""

    def setup(self, trainer, pl_module, stage) -> None:
        self.fp32 = {n: b.detach().clone() for n, b in pl_module.named_buffers() if b.dtype == torch.float32}

    def on_fit_start(self, trainer, pl_module) -> None:
        for module_name, module in pl_module.named_modules():
            for key, buf in module._buffers.items():
                name = f"{module_name}.{key}" if module_name else key
                if buf is not None and name in self.fp32 and buf.dtype != torch.float32:
                    module._buffers[key] = self.fp32[name].to(buf.device)
        self.fp32 = {}


def gather_full_weights(trainer, module) -> None:
    """After fit under ZeRO-3 or FSDP (whose parameters are partitions): every rank takes part in gathering the
    full weights, and rank zero puts CPU copies of them into ``module``'s parameters, so that the export (and
    anything else rank zero reads after training) sees whole tensors. A no-op under other strategies."""
    kind = strategy_kind(trainer.strategy)
    expert_parallel = getattr(getattr(module, "patch", None), "expert_parallel", None)
    if expert_parallel is not None:
        expert_parallel.uninstall()  # every rank gathers the experts back: whole tensors, HF's own forward
        return
    params = list(module.parameters())
    if kind == "deepspeed_zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            full = [p.data.detach().cpu().clone() for p in params] if trainer.is_global_zero else None
    elif kind == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # one rank: FSDP runs NO_SHARD, where summon_full_params refuses offload_to_cpu (the params are full anyway)
        offload = trainer.world_size > 1
        with FSDP.summon_full_params(trainer.strategy.model, writeback=False, rank0_only=True, offload_to_cpu=offload):
            full = [p.data.detach().cpu().clone() for p in params] if trainer.is_global_zero else None
    else:
        return
    if full is not None:
        for p, value in zip(params, full):
            p.data = value


def optimizer_stepped(trainer) -> bool:
    """True when the ``optimizer_step`` call now running is a real optimizer step. Under DeepSpeed (a strategy
    that handles gradient accumulation) Lightning calls ``optimizer_step`` on every micro-batch and the engine
    steps only at the accumulation boundary, which Lightning's loop reports as not ``_should_accumulate()``."""
    if trainer is None or not trainer.strategy.handles_gradient_accumulation:
        return True
    return not trainer.fit_loop._should_accumulate()
