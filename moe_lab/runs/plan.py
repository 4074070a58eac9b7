"""``python run.py <overrides> plan=true``: what the run would do, from the config and the data file alone. No
weight is loaded (the architecture comes from ``model.architecture`` / the tiny config / a local config.json, on the
meta device) and nothing trains. Printed and written to ``<run dir>/plan.json``:

* the model's total and active parameters, each with and without the input embedding, and which one the papers
  quote;
* the training data after the split and the overflow filter (the data file is read and tokenized), its tokens,
  micro-batches per epoch, optimizer steps and epochs (:func:`optimizer_steps`, Lightning's own arithmetic);
* warm-up and the schedule's key points, and when the method's own phases happen;
* the memory per GPU (GiB) for the chosen hardware by :mod:`moe_lab.analysis.estimate`, and the settings that fit;
* the evaluation sets and whether each can be read offline; the output directory.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..core.atomic import atomic_write_json
from ..core.settings import RunLength
from ..core.task_table import tasks_where
from ..methods.registry import method_of
from ..methods.schedules import lr_multiplier, warmup_steps_for
from .memory_fit import (
    ASSUMED_GPU_GB,
    device_memory_gb,
    fitting,
    memory_estimate,
    node_gpus,
    world_size,
)

log = logging.getLogger(__name__)


def optimizer_steps(rows: int, batch_size: int, accumulate: int, world: int, max_epochs: int, max_steps: int) -> dict:
    """Micro-batches per epoch per rank, optimizer steps and epochs of a run over ``rows`` training rows, as
    Lightning counts them: each rank gets ``ceil(rows / world)`` rows (the sampler pads), ``ceil(. / batch_size)``
    micro-batches, an optimizer step every ``accumulate`` of them and at the end of an epoch; ``max_steps`` ends the
    run first when set (``-1``: ``max_epochs`` epochs)."""
    micro = math.ceil(math.ceil(rows / world) / batch_size)
    length = RunLength(max_steps=max_steps, max_epochs=max_epochs, accumulate_grad_batches=accumulate)
    per_epoch = length.steps_per_epoch(micro)
    if per_epoch == 0:
        raise ValueError(f"{rows} training rows give no batch: the run would train nothing")
    steps = length.optimizer_steps(micro)
    return {"micro_batches_per_epoch": micro, "steps_per_epoch": per_epoch, "optimizer_steps": steps,
            "epochs": steps / per_epoch, "sequences_per_step": batch_size * accumulate * world}


def schedule_points(total: int, scheduler) -> dict:
    """Warm-up steps and the learning-rate multiplier at the schedule's key points (0-based optimizer steps)."""
    s = OmegaConf.to_container(scheduler, resolve=True) if scheduler is not None else {}
    name, ratio = s.get("name", "constant"), s.get("warmup_ratio")
    warmup = warmup_steps_for(total, int(s.get("warmup_steps", 0) or 0), ratio)
    keys = sorted({0, min(warmup, total - 1), total // 4, total // 2, (3 * total) // 4, total - 1} - {-1})
    points = [(k, lr_multiplier(k, total, name, warmup, float(s.get("min_lr_ratio", 0.0) or 0.0))) for k in keys]
    return {"name": name, "warmup_steps": warmup, "warmup_ratio": ratio, "points": points}


def _tokenizer(model_cfg) -> tuple[object, str]:
    """The run's tokenizer when it can be read locally, else moe-lab's byte tokenizer with how that counts."""
    from ..data.tokenizer import build_byte_tokenizer

    name = model_cfg.get("tokenizer") or model_cfg.get("pretrained")
    if name in (None, "byte"):
        return build_byte_tokenizer(), "byte tokenizer (the model's own)"
    from transformers import AutoTokenizer

    try:  # local files only: a directory, or the local HF cache
        tok = AutoTokenizer.from_pretrained(str(name), local_files_only=True)
    except (OSError, ValueError):
        return build_byte_tokenizer(), (f"ESTIMATE: {name}'s tokenizer is not available locally, so tokens are "
                                        "UTF-8 bytes (moe-lab's byte tokenizer): a BPE tokenizer gives ~3-5x fewer, "
                                        "and the max_length filter is pessimistic (more truncation than real)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok, f"{name} (read locally)"


def data_plan(dataset_cfg, tokenizer) -> dict:
    """Rows after split and filter, and tokens, of a dataset config (the data module's own setup)."""
    dm = instantiate(dataset_cfg, tokenizer=tokenizer)
    dm.setup("fit")
    if hasattr(dm, "examples"):  # SFT-style rows
        train = dm.examples["train"]
        out = {"rows_read": sum(len(r) for r in dm.rows.values()), "train_examples": len(train),
               "val_examples": len(dm.examples.get("val", [])),
               "tokens": sum(len(e["input_ids"]) for e in train),
               "trained_tokens": sum(sum(1 for t in e["labels"] if t != -100) for e in train),
               "overflow": {k: dict(v) for k, v in dm.overflow_counts.items()}}
        out["train_rows"] = len(dm.packed_rows) if dm.packing else len(train)
        out["packed"] = bool(dm.packing)
        return out
    blocks = dm.blocks.get("train")  # text blocks (distillation, LM stage)
    rows = len(blocks) if blocks is not None else int(dm.num_blocks)
    return {"train_rows": rows, "tokens": rows * int(dm.block_size), "block_size": int(dm.block_size),
            "streamed": blocks is None}


def method_phases(cfg: DictConfig, length: dict | None) -> list[str]:
    """When the method's (and the task's) own phases happen."""
    out = []
    method = method_of(cfg)
    if method is not None and method.plan_lines is not None:
        out += method.plan_lines(cfg, length)
    task = cfg.task.name
    if task == "moe_to_dense":
        cal = cfg.compress.calibration
        out.append(f"calibration: {cal.num_sequences} x {cal.seq_len} tokens (compress.calibration) before "
                   f"conversion (score {cfg.compress.score}, grouping {cfg.compress.grouping}, K {cfg.compress.K}), "
                   "then distillation")
    if task in ("condense", "cd_moe_sft"):
        c = cfg.condense
        out.append(f"CD-MoE search: {c.search.num_sequences} x {c.search.seq_len} tokens, {c.num_layers} layers, "
                   f"{c.routed_experts} routed experts kept ({c.expert_selection} / {c.layer_selection})"
                   + ("; then SFT of the condensed layers" if task == "cd_moe_sft" else ""))
    return out


def eval_plan(cfg: DictConfig) -> list[tuple[str, str]]:
    """``(set, where it comes from / offline?)`` for every evaluation set and lm-eval task of the run."""
    from ..eval.eval_sets import data_dir, resolve
    from ..eval.lm_eval_bridge import local_tasks

    out = []
    ev = cfg.get("eval")
    if ev is not None and ev.get("datasets"):
        paths = ev.get("paths") or {}
        for spec in resolve(list(ev.datasets)):
            given = paths.get(spec.name)
            if given:
                out.append((spec.name, f"{given}: {'offline' if Path(given).exists() else 'MISSING'}"))
            elif spec.file:
                local = data_dir(ev.get("data_dir")) / spec.file
                out.append((spec.name, f"{local}: {'offline' if local.is_file() else 'MISSING'}"))
            elif spec.hub:
                out.append((spec.name, f"hub {spec.hub}: offline only from the local HF cache"))
            else:
                out.append((spec.name, f"NOT offline: on no hub ({spec.source_url}); set eval.paths.{spec.name}"))
    tasks = list((OmegaConf.select(cfg, "eval.lm_eval.tasks", default=None) or {}).values())
    tasks = [str(t.task) for t in tasks] + list(OmegaConf.select(cfg, "condense.eval.tasks", default=None) or [])
    local = set(local_tasks())
    for task in tasks:
        out.append((task, "lm-eval, moe-lab's offline task" if task in local
                    else "lm-eval hub task: downloads its data unless in the local HF cache"))
    return out


#: which active count the papers quote (the input embedding is a lookup, not a matmul, so model cards leave it out)
ACTIVE_CONVENTION = ("the papers' and model cards' active counts leave the input embedding out (Expert Condenser "
                     "paper: DeepSeek-V2-Lite 2.4B, GPT-OSS-20B 3.6B; the Compressed Experts paper's OLMoE 1.28B "
                     "counts it); totals count every parameter (16B, 20B)")


def parameter_counts(model_cfg) -> dict:
    """Total and active (per token) parameters of the model, each with and without the input embedding, counted
    on its meta-device twin (:func:`moe_lab.analysis.meta_costs.count_parameters`)."""
    import torch

    from ..analysis.estimate import architecture_config
    from ..analysis.meta_costs import count_parameters, meta_model, quiet_init

    with quiet_init():
        counts = count_parameters(meta_model(architecture_config(model_cfg), torch.bfloat16))
    return {"total": counts.total, "total_no_input_embedding": counts.total - counts.input_embedding,
            "active": counts.active(), "active_no_input_embedding": counts.active() - counts.input_embedding,
            "input_embedding": counts.input_embedding}


def parameter_line(p: dict) -> str:
    """The plan's line on the model's size: both counts, and which one the papers quote."""
    b = 1e9
    return (f"parameters: total {p['total'] / b:.2f}B ({p['total_no_input_embedding'] / b:.2f}B without the input "
            f"embedding); active per token {p['active'] / b:.2f}B counting the input embedding "
            f"({p['input_embedding'] / b:.2f}B), {p['active_no_input_embedding'] / b:.2f}B without it: "
            + ACTIVE_CONVENTION)


def check_method(cfg: DictConfig, optimizer_steps: int | None = None) -> str:
    """Build the method on the model's meta-device twin (no weights) and refuse what the run would refuse before
    its first step (:func:`~.checks.refuse_before_first_step`, the run's own check), given the run's
    ``optimizer_steps``. Returns what was checked."""
    import torch

    from ..analysis.estimate import architecture_config
    from ..analysis.meta_costs import meta_model, quiet_init
    from ..runtime.strategies import config_strategy_kind
    from .checks import refuse_before_first_step

    if cfg.task.name != "finetune":
        return f"method built by task={cfg.task.name} itself: not checked here"
    with quiet_init():
        model = meta_model(architecture_config(cfg.model), torch.bfloat16)
    module = instantiate(cfg.method, model=model, optim=cfg.task.optim, scheduler=cfg.task.scheduler,
                         _recursive_=False)
    refuse_before_first_step(cfg, module, optimizer_steps)
    return (f"method={cfg.method.name} builds on the meta model and runs under "
            f"{config_strategy_kind(cfg.hardware.trainer)}")


def plan(cfg: DictConfig) -> dict:
    """Print the plan of ``cfg`` and write ``plan.json``; loads no weights, trains nothing."""
    from ..analysis.estimate import architecture_config

    out_dir = Path(cfg.paths.output_dir)
    model = cfg.model
    arch = ("model.architecture (the public config.json, typed in)" if model.get("architecture")
            else "model.config (a config built from config_class)" if model.get("config_class")
            else f"{model.pretrained}/config.json (local)")
    architecture_config(model)  # refuses a model whose architecture cannot be read offline
    params = parameter_counts(model)
    world, world_note = world_size(cfg)
    summary: dict = {"task": cfg.task.name, "model": model.name, "method": cfg.method.get("name"),
                     "architecture": arch, "parameters": params, "world_size": world, "output_dir": str(out_dir)}
    lines = [(f"task={cfg.task.name} model={model.name} method={cfg.method.get('name')}; architecture from {arch}; "
              "no weights loaded"),
             parameter_line(params), f"data-parallel ranks: {world}" + (f" ({world_note})" if world_note else "")]
    length = None
    if cfg.task.name in tasks_where(trains=True) and "trainer" in cfg.task:
        tokenizer, how = _tokenizer(model)
        data = data_plan(cfg.dataset, tokenizer)
        run = RunLength.given(cfg.task.trainer)
        length = optimizer_steps(data["train_rows"], int(cfg.dataset.batch_size), run.accumulate_grad_batches,
                                 world, run.max_epochs, run.max_steps)
        sched = schedule_points(length["optimizer_steps"], cfg.task.get("scheduler"))
        summary.update(data=data, tokenizer=how, length=length, schedule=sched)
        if "train_examples" in data:
            o = data["overflow"].get("train", {})
            lines.append(f"data: {data['rows_read']} rows read; train {data['train_examples']} examples after the "
                         f"max_length={cfg.dataset.max_length} filter ({o.get('truncated', 0)} truncated, "
                         f"{o.get('too_long', 0) + o.get('no_labels', 0)} dropped), val {data['val_examples']}"
                         + (f"; packed into {data['train_rows']} rows" if data["packed"] else ""))
            lines.append(f"tokens: {data['tokens']:,} in train examples, {data['trained_tokens']:,} trained "
                         f"(tokenizer: {how})")
        else:
            lines.append(f"data: {data['train_rows']} blocks of {data['block_size']} tokens = {data['tokens']:,} "
                         f"tokens{' (streamed: dataset.num_blocks)' if data['streamed'] else ''} (tokenizer: {how})")
        lines.append(f"length: {length['micro_batches_per_epoch']} micro-batches per epoch per rank, "
                     f"{length['steps_per_epoch']} optimizer steps per epoch ({length['sequences_per_step']} "
                     f"sequences per step), {length['optimizer_steps']} optimizer steps = {length['epochs']:.2f} "
                     "epochs")
        points = ", ".join(f"step {k}: {m:.3f}" for k, m in sched["points"])
        lines.append(f"schedule: {sched['name']}, warm-up {sched['warmup_steps']} steps"
                     + (f" (ratio {sched['warmup_ratio']})" if sched["warmup_ratio"] is not None else "")
                     + f"; lr x [{points}] (lr {cfg.task.optim.lr})")
    lines.insert(3, f"checks: {check_method(cfg, length['optimizer_steps'] if length else None)}")
    phases = method_phases(cfg, length)
    summary["phases"] = phases
    lines += [f"phase: {p}" for p in phases]
    if cfg.task.name in tasks_where(trains=True) and "trainer" in cfg.task:
        memory, source = device_memory_gb(cfg)
        if memory is None and str(cfg.hardware.trainer.get("accelerator")) != "cpu":
            memory, source = ASSUMED_GPU_GB, f"{ASSUMED_GPU_GB:.0f} GiB assumed (the papers' GPUs; no CUDA here)"
        est = memory_estimate(cfg, world, node_gpus())
        summary["memory"] = {**est, "device_gb": memory, "device": source}
        verdict = ("" if memory is None else f" vs {memory:.0f} GiB ({source}): "
                   + ("fits" if est["gpu_gb"] <= memory else "DOES NOT FIT, a run is refused"))
        lines.append(f"memory: {est['gpu_gb']:.1f} GiB per GPU (method {est['method']}, hardware={est['hardware']}, "
                     f"{est['batch']} x {est['seq_len']} tokens, activation checkpointing "
                     f"{'on' if est['checkpointing'] else 'off'}){verdict}"
                     + (f"; fits on {est['alternatives_gpus']} GPUs: {', '.join(fitting(est, memory)) or 'none'}"
                        if memory is not None else ""))
        if "ep_size" in est:
            lines.append(f"expert parallel: EP groups of {est['ep_size']} ranks, each holding 1/{est['ep_size']} of "
                         f"the routed experts; all-to-all {est['all_to_all_gb']:.2f} GiB sent per rank per micro-batch "
                         "(dispatch and combine, forward and backward)")
    evals = eval_plan(cfg)
    summary["eval"] = evals
    lines += [f"eval: {name}: {where}" for name, where in evals] or ["eval: none"]
    lines.append(f"output directory: {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "plan.json", summary, default=str)
    print("==== moe-lab plan (nothing loaded, nothing trained) ====\n" + "\n".join(f"  {line}" for line in lines),
          flush=True)
    return summary
