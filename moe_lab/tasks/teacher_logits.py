"""task=teacher_logits: record the teacher's logits over the run's training data, in the order method=kd reads it.

The teacher is ``method.teacher`` (a conf/model entry or a checkpoint path), else the run's ``model``. The
training loader is the run's ``dataset`` (tokenised with the run's model tokenizer), iterated as Lightning does
for task=finetune: epoch e after ``sampler.set_epoch(e)``, until ``task.trainer.max_steps`` x
``accumulate_grad_batches`` batches (or ``max_epochs`` whole epochs when max_steps <= 0). Writes
``task.file`` (default ``<run dir>/teacher_logits.safetensors``) with
``moe_lab.distill.teacher_logits.record_teacher`` (full logits, or ``task.top_k`` logits + log-sum-exp) and
prints the ``method.options.teacher_logits=<file>`` override for the distillation run (same dataset and loop
overrides, one process, no validation: a validation batch would consume record rows).
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from ..data.tokenizer import load_tokenizer
from ..distill.teacher import load_teacher
from ..distill.teacher_logits import record_teacher, save
from ..plain import to_plain

log = logging.getLogger(__name__)


def num_batches(trainer_cfg, per_epoch: int | None) -> int:
    """Micro-batches method=kd will read: max_steps x accumulate_grad_batches, else max_epochs x epoch length."""
    steps, accumulate = int(trainer_cfg.get("max_steps", -1)), int(trainer_cfg.get("accumulate_grad_batches", 1))
    if steps > 0:
        return steps * accumulate
    epochs = int(trainer_cfg.get("max_epochs", -1))
    if epochs <= 0 or per_epoch is None:
        raise ValueError("task=teacher_logits needs the length of the distillation run: set task.trainer.max_steps "
                         "(or task.trainer.max_epochs with a dataset of known length)")
    return epochs * per_epoch


def train_batches(loader, total: int):
    """``total`` batches of ``loader`` over as many epochs as needed, each epoch's order set as Lightning does."""
    sampler = getattr(loader, "sampler", None)
    for epoch in itertools.count():
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        seen = 0
        for batch in loader:
            if total == 0:
                return
            seen += 1
            total -= 1
            yield batch
        if total == 0 or seen == 0:
            return


def teacher_logits_task(cfg: DictConfig) -> dict:
    """Write the teacher record; returns a summary with the file and its token count."""
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(cfg.seed))
    model_cfg = to_plain(cfg.model)
    teacher_cfg = cfg.method.get("teacher") if "method" in cfg else None
    teacher = load_teacher(teacher_cfg if teacher_cfg is not None else model_cfg)
    tokenizer = load_tokenizer(model_cfg.get("tokenizer") or model_cfg.get("pretrained") or "byte")
    datamodule = instantiate(cfg.dataset, tokenizer=tokenizer)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    try:
        per_epoch = len(loader)
    except TypeError:
        per_epoch = None
    total = num_batches(cfg.task.trainer, per_epoch)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher.to(device)
    top_k = cfg.task.get("top_k")
    record = record_teacher(teacher, train_batches(loader, total), top_k=None if top_k is None else int(top_k))
    path = Path(cfg.task.get("file") or out / "teacher_logits.safetensors")
    save(record, path)
    tokens = int(next(iter(record.values())).shape[0])
    summary = {"file": str(path), "tokens": tokens, "batches": total, "top_k": top_k,
               "override": f"method.options.teacher_logits={path}"}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"==== moe-lab teacher_logits: {tokens} tokens of {total} batches -> {path}\n"
          f"distil with: method=kd method.options.teacher_logits={path} (same dataset and task.trainer overrides, "
          "task.trainer.limit_val_batches=0)", flush=True)
    return summary
