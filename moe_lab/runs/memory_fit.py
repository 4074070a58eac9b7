"""Per-GPU memory of a run by moe-lab's own estimate (:mod:`moe_lab.analysis.estimate`, meta device, no weights),
and the refusal, before any weight loads, of a run that would not fit the device it is about to use."""

from __future__ import annotations

import functools
import json
import logging

from omegaconf import DictConfig, OmegaConf

from ..methods.registry import method_of
from ..runtime.expert_parallel import ep_dense, ep_size
from ..runtime.strategies import config_strategy_kind

log = logging.getLogger(__name__)

#: estimate strategy -> the hardware setting that runs it (ddp on one GPU: hardware=gpu)
HARDWARE = {"ddp": "gpu_ddp", "zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3",
            "zero3_offload": "deepspeed_zero3_offload", "fsdp": "fsdp", "ep": "gpu_ep",
            "ep_ddp": "gpu_ep hardware.ep_dense=ddp"}
#: strategies the estimate rows of no installer are refused under (moe_lab.runtime.strategies: LoRA's adapters on
#: FSDP's flat parameters; KD's teacher and dense student are not expert parallel); an installer's are in its
#: registration (``refused_strategies``, and ``expert_parallel``)
REFUSED = {"lora": ("fsdp",), "kd": ("ep", "ep_ddp"), "dense_student": ("ep", "ep_ddp")}
ASSUMED_GPU_GB = 80.0  # GiB: the papers' machines, 8 x 80 GB GPUs (A100/H100 80GB: 80 GiB)
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def estimate_strategy(trainer_cfg) -> str:
    """The :data:`moe_lab.analysis.estimate.STRATEGIES` row of a ``hardware.trainer`` config."""
    kind = config_strategy_kind(trainer_cfg)
    if kind == "deepspeed_zero3":
        node = trainer_cfg.get("strategy")
        offload = hasattr(node, "get") and (node.get("offload_parameters") or node.get("offload_optimizer"))
        return "zero3_offload" if offload else "zero3"
    return {"deepspeed_zero2": "zero2", "fsdp": "fsdp"}.get(kind, "ddp")


def estimate_method(cfg: DictConfig) -> str:
    """The estimate's method row for ``cfg.method``: LoRA's, KD's, or its installer's ``cost_row`` (``sft``
    where it names none)."""
    if cfg.method.get("lora"):
        return "lora"
    if cfg.method.get("name") == "kd":  # teacher (frozen) + student
        return "kd"
    row = getattr(method_of(cfg), "cost_row", None)
    return row(cfg) if callable(row) else row or "sft"


def refused_strategies(cfg: DictConfig, row: str) -> tuple[str, ...]:
    """The estimate strategies ``cfg``'s method (estimate ``row``) is refused under."""
    if row in REFUSED:
        return REFUSED[row]
    spec = method_of(cfg)
    return () if spec is None else spec.refused_strategies + (() if spec.expert_parallel else ("ep", "ep_ddp"))


def sequence(cfg: DictConfig) -> tuple[int, int]:
    """``(tokens per sequence, sequences per micro-batch per GPU)`` of the training data."""
    d = cfg.dataset
    return int(d.get("max_length") or d.get("block_size") or 2048), int(d.get("batch_size") or 1)


@functools.lru_cache(maxsize=32)
def _estimate(model_json: str, seq_len: int, batch: int, gpus: int, dtype: str, condenser_n: int,
              with_student: bool) -> dict:
    from .. import methods as _methods  # noqa: F401  (each method's module registers its row of the estimate)
    from ..analysis.estimate import Options, architecture_config, estimate
    from ..models import DTYPES

    config = architecture_config(OmegaConf.create(json.loads(model_json)))
    return estimate(config, seq_len=seq_len, batch=batch, opts=Options(condenser_n=condenser_n), gpus=gpus,
                    param_bytes=BYTES.get(dtype, 2), dtype=DTYPES[dtype], with_student=with_student)


def memory_estimate(cfg: DictConfig, gpus: int, alternatives_gpus: int | None = None) -> dict:
    """The estimate for this run: its method, strategy, activation checkpointing, GiB per GPU on ``gpus`` ranks, and
    (``options``: [(hardware, GiB)]) every strategy's GiB per GPU for the same method on ``alternatives_gpus`` ranks
    (default ``gpus``; the sharded settings run on every GPU of the node), refused strategies left out."""
    experts_over = ep_size(cfg)
    method = estimate_method(cfg)
    strategy = ("ep" if ep_dense(cfg) == "zero1" else "ep_ddp") if experts_over > 1 else \
        estimate_strategy(cfg.hardware.trainer)
    seq_len, batch = sequence(cfg)
    ckpt = bool(cfg.method.get("gradient_checkpointing", False))
    n = int(OmegaConf.select(cfg, "method.options.n", default=2) or 2) if method.startswith("condenser") else 2
    dtype = str(cfg.model.get("dtype") or "bfloat16")
    model = json.dumps(OmegaConf.to_container(cfg.model, resolve=True), sort_keys=True)
    gpus, alt = max(1, gpus), max(1, alternatives_gpus or gpus)

    def rows(ranks: int) -> dict:
        # the ddp row does not depend on the number of ranks: one estimate serves both when the run is unsharded
        result = _estimate(model, seq_len, batch, ranks, dtype, n, method == "kd")
        if method not in result["methods"]:
            raise ValueError(f"method {cfg.method.get('name')}: {method} is not defined for this model's routing "
                             f"(model={cfg.model.get('name')}; a top-1 router has no auxiliary expert): choose "
                             "another method")
        return {r["strategy"]: r for r in result["methods"][method]["memory"] if r["activation_checkpointing"] == ckpt}

    alternatives = rows(alt)
    current = rows(experts_over) if strategy.startswith("ep") else alternatives if strategy == "ddp" or alt == gpus \
        else rows(gpus)
    names = {**HARDWARE, "ddp": "gpu" if gpus <= 1 else "gpu_ddp"}
    options = [(HARDWARE[s] if s != "ddp" else names["ddp"], r["gpu_total_gb"]) for s, r in alternatives.items()
               if s not in refused_strategies(cfg, method)]
    return {"method": method, "strategy": strategy, "hardware": names[strategy], "checkpointing": ckpt,
            "seq_len": seq_len, "batch": batch, "gpus": gpus, "alternatives_gpus": alt,
            "gpu_gb": current[strategy]["gpu_total_gb"], "cpu_gb": current[strategy]["cpu_gb"], "options": options,
            **({"ep_size": experts_over, "all_to_all_gb": current[strategy]["all_to_all_gb"]}
               if strategy.startswith("ep") else {})}


def device_memory_gb(cfg: DictConfig) -> tuple[float | None, str]:
    """``(GiB, where from)`` of the GPU this run is about to use: ``hardware.gpu_memory_gb`` when set, else the CUDA
    device's own (GPU hardware on a CUDA machine), else ``(None, why not)``."""
    given = OmegaConf.select(cfg, "hardware.gpu_memory_gb", default=None)
    if given is not None:
        return float(given), "hardware.gpu_memory_gb"
    if str(OmegaConf.select(cfg, "hardware.trainer.accelerator", default="auto")) not in ("gpu", "cuda", "auto"):
        return None, "not a GPU run"
    return _cuda_memory_gb()


def _cuda_memory_gb() -> tuple[float | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.total_memory / 2**30, props.name


def world_size(cfg: DictConfig) -> tuple[int, str]:
    """``(data-parallel ranks, note)``: ``hardware.trainer.devices``; ``-1``/``auto`` is every CUDA GPU here, or
    (planning without one) 8, the papers' nodes."""
    trainer = cfg.hardware.trainer
    devices = trainer.get("devices", 1)
    if isinstance(devices, int) and devices >= 1:
        return devices, ""
    if isinstance(devices, str) and devices.isdigit():
        return int(devices), ""
    if str(trainer.get("accelerator", "auto")) == "cpu":
        return 1, ""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), f"devices={devices}: the {torch.cuda.device_count()} CUDA GPUs here"
    return 8, f"devices={devices} (every GPU): 8 assumed (no CUDA here; set hardware.trainer.devices=N)"


def fitting(estimate: dict, memory_gb: float) -> list[str]:
    """``hardware=<name> (<GiB> GiB)`` of every strategy whose estimate fits ``memory_gb`` (sharded ones on
    ``alternatives_gpus`` GPUs)."""
    return [f"hardware={name} ({gb:.1f} GiB)" for name, gb in estimate["options"] if gb <= memory_gb]


def node_gpus() -> int:
    """GPUs of this node (CUDA), else 8, the papers' nodes: what a sharded setting with ``devices=-1`` runs on."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 8


def check_memory(cfg: DictConfig) -> None:
    """Refuse a fine-tuning run whose estimated memory per GPU exceeds the GPU it is about to use, naming the
    estimate and the hardware settings that fit. Nothing is checked on CPU or when the device memory is unknown."""
    if cfg.task.name != "finetune":
        return
    memory, source = device_memory_gb(cfg)
    if memory is None:
        return
    est = memory_estimate(cfg, world_size(cfg)[0], node_gpus())
    if est["gpu_gb"] <= memory:
        log.info("memory: %.1f GiB per GPU estimated (method=%s, hardware=%s, %d GPUs), %.0f GiB available (%s)",
                 est["gpu_gb"], est["method"], est["hardware"], est["gpus"], memory, source)
        return
    fit = fitting(est, memory)
    ckpt = "" if est["checkpointing"] else "; or method.gradient_checkpointing=true"
    raise ValueError(
        f"memory: moe-lab's estimate is {est['gpu_gb']:.1f} GiB per GPU for method={cfg.method.name} "
        f"({est['method']}) under hardware={est['hardware']} ({est['gpus']} GPU{'s' * (est['gpus'] != 1)}, "
        f"{est['batch']} x {est['seq_len']} tokens per micro-batch, activation checkpointing "
        f"{'on' if est['checkpointing'] else 'off'}), above the {memory:.0f} GiB of this GPU ({source}). "
        + (f"Hardware settings that fit (on {est['alternatives_gpus']} GPUs): {', '.join(fit)}" if fit
           else "No hardware setting fits at this size")
        + f"{ckpt}; or a smaller dataset.batch_size (python run.py ... task=estimate shows every setting)")
