"""Multi-GPU strategies on CPU: every hardware config composes and builds its strategy (stage, offload,
precision, fp32 master weights), ZeRO-3 leaf modules, refusals, device checks, and the optimizer-step boundary
under a strategy that accumulates gradients itself (DeepSpeed). Real ZeRO / FSDP runs are marked ``gpu``."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy
from omegaconf import OmegaConf

from moe_lab.methods.base import MoELightningModule
from moe_lab.runtime.strategies import (
    AccumulateOnceDeepSpeedPrecision,
    KeepFp32Buffers,
    build_strategy,
    check_devices,
    config_strategy_kind,
    prepare,
    refuse_unsupported,
    strategy_kind,
)
from tests.conftest import build_tiny, random_batch

ROOT = Path(__file__).resolve().parents[2]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _compose(*overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))


def _strategy(hardware):
    cfg = _compose(f"hardware={hardware}")
    kwargs = OmegaConf.to_container(cfg.hardware.trainer, resolve=True)
    assert kwargs["accelerator"] == "gpu" and kwargs["precision"] == "bf16-mixed"  # bf16 over fp32 masters
    kwargs["accelerator"], kwargs["devices"] = "cpu", 1  # the device check would refuse GPUs here
    return cfg, build_strategy(kwargs)


@pytest.mark.parametrize("hardware,stage,offload", [("deepspeed_zero2", 2, False), ("deepspeed_zero3", 3, False),
                                                    ("deepspeed_zero3_offload", 3, True)])
def test_deepspeed_configs(hardware, stage, offload):
    cfg, strategy = _strategy(hardware)
    assert isinstance(strategy, DeepSpeedStrategy) and strategy_kind(strategy) == f"deepspeed_zero{stage}"
    assert config_strategy_kind(cfg.hardware.trainer) == f"deepspeed_zero{stage}"
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) == offload and ("offload_param" in zero) == offload
    if offload:
        assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
        assert strategy.config["zero_force_ds_cpu_optimizer"] is False  # moe-lab's torch AdamW is allowed
    # bf16-mixed under DeepSpeed = bf16 parameters with fp32 master copies in DeepSpeed's optimizer
    from lightning.fabric.strategies.deepspeed import _format_precision_config

    _format_precision_config(strategy.config, cfg.hardware.trainer.precision, 0, 1000, 1, 16, 2)  # what fit does
    assert strategy.config["bf16"]["enabled"] is True and "fp16" not in strategy.config
    assert strategy.handles_gradient_accumulation  # Lightning calls optimizer_step on every micro-batch


@pytest.mark.parametrize("accumulate", [1, 4])
def test_deepspeed_divides_the_loss_by_the_accumulation_once(accumulate):
    """Lightning's automatic optimisation divides training_step's loss by accumulate_grad_batches; DeepSpeed's
    engine.backward would divide it again (scale_wrt_gas=True by default). Oracle: DeepSpeedEngine.backward's
    own arithmetic run on a stand-in engine: the loss that reaches autograd is the closure loss, divided by A
    exactly once."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from lightning.pytorch.loops.optimization.automatic import ClosureResult

    _, strategy = _strategy("deepspeed_zero2")
    plugin = strategy.precision_plugin
    assert isinstance(plugin, AccumulateOnceDeepSpeedPrecision) and plugin.precision == "bf16-mixed"
    seen = {}

    class Engine:  # DeepSpeedEngine.backward's loss scaling, then hand the result to autograd
        def gradient_accumulation_steps(self):
            return accumulate

        def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
            seen["loss"] = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    model = L.LightningModule()
    model._trainer = SimpleNamespace(model=Engine())  # the plugin reaches the engine as trainer.model
    closure = ClosureResult.from_training_step_output(torch.tensor(12.0), accumulate).loss  # Lightning's 1/A
    plugin.backward(closure, model, None)
    assert float(seen["loss"]) == 12.0 / accumulate
    backward = inspect.getclosurevars(DeepSpeedEngine.backward).nonlocals["func"]  # tripwire on the real engine
    assert "loss = loss / self.gradient_accumulation_steps() if scale_wrt_gas" in inspect.getsource(backward)


def test_fsdp_config_keeps_fp32_masters_and_reduces_in_fp32():
    cfg, strategy = _strategy("fsdp")
    assert isinstance(strategy, FSDPStrategy) and config_strategy_kind(cfg.hardware.trainer) == "fsdp"
    mp = strategy.mixed_precision_config
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert str(strategy.sharding_strategy) == "ShardingStrategy.FULL_SHARD"
    assert strategy.kwargs["use_orig_params"] is True  # per-group optimizer settings on the original parameters
    module = MoELightningModule(build_tiny("qwen3_moe").to(torch.bfloat16), "sft")
    prepare(SimpleNamespace(strategy=strategy, callbacks=[]), module)
    assert all(p.dtype == torch.float32 for p in module.parameters())  # sharded fp32 master weights
    policy = strategy.kwargs["auto_wrap_policy"]
    layer = type(module.model.model.layers[0])
    assert layer.__name__ in module.model._no_split_modules and policy._module_classes == {layer}


def test_gpu_ddp_config():
    cfg, strategy = _strategy("gpu_ddp")
    assert isinstance(strategy, DDPStrategy) and strategy._process_group_backend == "nccl"
    assert config_strategy_kind(cfg.hardware.trainer) == "ddp"
    assert config_strategy_kind(_compose("hardware=cpu").hardware.trainer) == "single"


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "gpt_oss"])
def test_zero3_leaf_modules_are_the_moe_blocks(family):
    """Oracle: the decoder layers' MLP slots that hold an MoE block (by the HF class name in the registry),
    found by walking model.model.layers, not through the view code."""
    from deepspeed.utils import get_z3_leaf_modules

    from moe_lab.moe.registry import family_spec

    model = build_tiny(family)
    block_name = family_spec(model.config.model_type).block_class
    hf_blocks = [layer.mlp for layer in model.model.layers if type(layer.mlp).__name__ == block_name]
    assert hf_blocks
    module = MoELightningModule(model, "sft")
    _, strategy = _strategy("deepspeed_zero3")
    callbacks = []
    prepare(SimpleNamespace(strategy=strategy, callbacks=callbacks), module)
    installed = [layer.mlp for layer in model.model.layers if layer.mlp in module.patch.layers]
    assert get_z3_leaf_modules(model) == installed and len(installed) == len(hf_blocks)
    assert any(isinstance(c, KeepFp32Buffers) for c in callbacks)
    module.patch.remove()  # export puts the HF blocks back: they are leaves too
    assert get_z3_leaf_modules(model) == hf_blocks


def test_zero2_marks_no_leaf_and_allows_densemixer():
    from deepspeed.utils import get_z3_leaf_modules

    module = MoELightningModule(build_tiny("olmoe"), "densemixer")
    _, strategy = _strategy("deepspeed_zero2")
    prepare(SimpleNamespace(strategy=strategy, callbacks=[]), module)
    assert get_z3_leaf_modules(module.model) == []


@pytest.mark.parametrize("hardware", ["deepspeed_zero3", "deepspeed_zero3_offload", "fsdp"])
def test_densemixer_runs_under_sharded_experts(hardware):
    """Its inactive-expert pass runs inside the gathered scope (tests/runtime/test_sharded_densemixer.py)."""
    module = MoELightningModule(build_tiny("olmoe"), "densemixer")
    _, strategy = _strategy(hardware)
    prepare(SimpleNamespace(strategy=strategy, callbacks=[]), module)


def test_fsdp_refuses_lora_on_packed_experts_and_expert_slices():
    _, strategy = _strategy("fsdp")
    lora = MoELightningModule(build_tiny("olmoe"), "sft", lora={"rank": 2, "alpha": 4, "targets": ["experts"]})
    with pytest.raises(ValueError, match="LoRA on packed experts.*parametrization"):
        prepare(SimpleNamespace(strategy=strategy, callbacks=[]), lora)
    esft = MoELightningModule(build_tiny("olmoe"), "esft", options={"experts": {i: [0] for i in range(2)}})
    with pytest.raises(ValueError, match="expert slices"):
        prepare(SimpleNamespace(strategy=strategy, callbacks=[]), esft)
    esft = MoELightningModule(build_tiny("olmoe"), "esft", options={"experts": {i: [0] for i in range(2)}},
                              optim={"weight_decay": 0.1})
    refuse_unsupported(esft, "deepspeed_zero3", "bf16-mixed")  # decayed on ZeRO's masters (methods/slice_decay)
    refuse_unsupported(esft, "deepspeed_zero2", "32-true")
    for kind in ("deepspeed_zero2", "deepspeed_zero3"):  # fp16's loss scaler may skip the step after the decay
        with pytest.raises(ValueError, match="fp16's loss scaler may then skip"):
            refuse_unsupported(esft, kind, "16-mixed")


def test_forward_only_passes_go_through_the_fsdp_root():
    """A probe that called an inner FSDP unit before the root would make it a root (the GPU run's
    `_is_root` assertion): under FSDP the forward is the strategy's root wrapper, else the HF model."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from moe_lab.runtime.strategies import model_forward

    pl_module = SimpleNamespace(model=torch.nn.Linear(2, 2))
    fsdp, root = FSDPStrategy(), torch.nn.Identity()
    fsdp.model = root
    assert model_forward(SimpleNamespace(strategy=fsdp), pl_module) is root
    assert model_forward(SimpleNamespace(strategy=DDPStrategy()), pl_module) is pl_module.model
    assert model_forward(None, pl_module) is pl_module.model


def test_fsdp_clips_by_the_global_norm_through_the_root():
    """Lightning's FSDPPrecision refuses gradient_clip_algorithm='norm' (the H200 run's failure): the module clips
    through the FSDP root's clip_grad_norm_; other strategies keep Lightning's clipping."""
    from types import SimpleNamespace
    from unittest import mock

    from lightning.pytorch.strategies import FSDPStrategy

    from moe_lab.methods.base import MoELightningModule

    module = MoELightningModule.__new__(MoELightningModule)
    fsdp = FSDPStrategy()
    fsdp.model = SimpleNamespace(clip_grad_norm_=mock.Mock())
    with mock.patch.object(MoELightningModule, "trainer", SimpleNamespace(strategy=fsdp)), \
            mock.patch.object(L.LightningModule, "configure_gradient_clipping") as lightning_clip:
        module.configure_gradient_clipping(None, 1.0, "norm")
        fsdp.model.clip_grad_norm_.assert_called_once_with(1.0)
        lightning_clip.assert_not_called()
        with pytest.raises(ValueError, match="gradient_clip_algorithm=value under FSDP"):
            module.configure_gradient_clipping(None, 1.0, "value")
    single = SimpleNamespace(strategy=SimpleNamespace())
    with mock.patch.object(MoELightningModule, "trainer", single), \
            mock.patch.object(L.LightningModule, "configure_gradient_clipping") as lightning_clip:
        module.configure_gradient_clipping("opt", 1.0, "norm")
        lightning_clip.assert_called_once_with("opt", 1.0, "norm")


def test_keep_fp32_buffers_restores_exact_values():
    """DeepSpeed's bf16 engine calls module.bfloat16(); the condenser's fp32 selection biases come back exactly."""
    module = MoELightningModule(build_tiny("olmoe"), "condenser", options={"n": 0})
    for layer in module.patch.layers:
        layer.bias.copy_(torch.linspace(-1e-4, 1e-4, layer.bias.numel()) + 1.0)  # not representable in bf16
    before = {n: b.clone() for n, b in module.named_buffers() if b.dtype == torch.float32}
    keep = KeepFp32Buffers()
    keep.setup(None, module, "fit")
    module.bfloat16()  # what the engine does
    assert module.patch.layers[0].bias.dtype == torch.bfloat16
    keep.on_fit_start(None, module)
    after = dict(module.named_buffers())
    assert before and all(after[n].dtype == torch.float32 and torch.equal(after[n], v) for n, v in before.items())


def test_devices_above_what_the_machine_has_are_named():
    with pytest.raises(ValueError) as err:
        check_devices({"accelerator": "gpu", "devices": 4 + torch.cuda.device_count()})
    msg = str(err.value)
    assert msg.startswith(f"trainer.devices={4 + torch.cuda.device_count()}") and "CUDA GPU" in msg
    if not torch.cuda.is_available():
        assert "0 CUDA GPUs" in msg and "hardware=cpu" in msg
    cores = os.cpu_count()
    with pytest.raises(ValueError, match=f"trainer.devices={cores + 1} .*{cores} CPU cores.*hardware=cpu"):
        check_devices({"accelerator": "cpu", "devices": cores + 1})
    check_devices({"accelerator": "cpu", "devices": 1})
    check_devices({"accelerator": "gpu", "devices": -1})  # Lightning resolves "all"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
def test_finetune_build_trainer_refuses_gpu_hardware_on_cpu(tmp_path):
    from moe_lab.runtime.trainer import build_trainer

    cfg = _compose("hardware=deepspeed_zero3", "hardware.trainer.devices=4")
    with pytest.raises(ValueError, match=r"trainer.devices=4 \(trainer.accelerator=gpu\): this machine has 0"):
        build_trainer(cfg, tmp_path, [], [])


class _Accumulating(SingleDeviceStrategy):
    """A strategy that, like DeepSpeed, handles gradient accumulation itself (Lightning then calls
    ``optimizer_step`` on every micro-batch)."""

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {k: v[0] for k, v in random_batch(batch=1, seq=8, seed=i, pad_rows=()).items()}


@pytest.mark.parametrize("strategy", ["default", "accumulating"])
def test_method_step_hooks_run_once_per_optimizer_step(strategy, tmp_path):
    """Oracle: Lightning's own count of optimizer steps (trainer.global_step). With 3 accumulated micro-batches and
    2 steps, the condenser's bias update (a patch step hook) runs twice, also where optimizer_step is called on all
    6 micro-batches."""
    module = MoELightningModule(build_tiny("olmoe"), "sft", optim={"lr": 1e-3})
    hooks, calls = [], []
    module.patch.step_hooks.append(lambda: hooks.append(module.trainer.global_step))
    original = module.optimizer_step

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    module.optimizer_step = counted
    kw = {"strategy": _Accumulating(device=torch.device("cpu"))} if strategy == "accumulating" else {}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, accumulate_grad_batches=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, **kw)
    trainer.fit(module, torch.utils.data.DataLoader(_Data(), batch_size=2))
    assert trainer.global_step == 2 and len(hooks) == 2
    assert len(calls) == (6 if strategy == "accumulating" else 2)


# ---- real multi-GPU runs (skipped without CUDA) ---------------------------------------------------------
@gpu
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("hardware", ["deepspeed_zero2", "deepspeed_zero3", "fsdp"])
def test_real_sharded_run(hardware, tmp_path):
    """A tiny OLMoE trains 4 steps under the strategy, writes a COMPLETED checkpoint and an export that vanilla
    transformers loads; under ZeRO the checkpoint also converts to an HF export."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "run.py", f"hardware={hardware}", "hardware.trainer.devices=1", "debug=fast",
           "logger=none", "task.trainer.max_steps=4", "task.checkpoint_every_n_steps=2", f"hydra.run.dir={out}"]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "WANDB_MODE": "offline"})
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "export")
    ckpt = out / "checkpoints" / "last.ckpt"
    assert (ckpt / "COMPLETED").is_file() if ckpt.is_dir() else (out / "checkpoints" / "last.ckpt.COMPLETED").is_file()
    if hardware.startswith("deepspeed"):
        from moe_lab.runtime.checkpoint_io import convert_zero_checkpoint

        convert_zero_checkpoint(ckpt, tmp_path / "converted")
        AutoModelForCausalLM.from_pretrained(tmp_path / "converted")
