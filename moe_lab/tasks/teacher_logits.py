"""task=teacher_logits: record the teacher's logits over the run's data, in the order method=kd reads it.

The teacher is ``method.teacher`` (a conf/model entry or a checkpoint path), else the run's ``model``. The
distillation run's data-parallel size W is ``task.world_size``, else devices x num_nodes of its trainer
(``hardware.trainer`` updated by ``task.trainer``, as task=finetune builds it). For each rank r < W the run's
``dataset`` (tokenised with the run's model tokenizer) gives the train loader rank r will read (its shard:
``data_parallel_shard() = (W, r)``), iterated as Lightning does: epoch e after ``sampler.set_epoch(e)``, at most
``limit_train_batches`` batches an epoch, until ``max_steps`` x ``accumulate_grad_batches`` batches (or
``max_epochs`` epochs when max_steps <= 0); and, unless ``limit_val_batches`` is 0, the batches of one validation
run (rank r's ``DistributedSampler`` share when W > 1, as Lightning shards it; at most ``limit_val_batches``).
Writes ``task.file`` (default ``<run dir>/teacher_logits.safetensors``; format in
``moe_lab.distill.teacher_logits``: full logits, or ``task.top_k`` logits + log-sum-exp, with each batch's token
count and checksum) and prints the ``method.options.teacher_logits=<file>`` override for the distillation run.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from ..core.atomic import atomic_write_json
from ..core.plain import to_plain
from ..core.settings import RunLength
from ..data.tokenizer import load_tokenizer
from ..distill.teacher import load_teacher
from ..distill.teacher_logits import record_run, save_run

log = logging.getLogger(__name__)


def num_batches(trainer_cfg, per_epoch: int | None) -> int:
    """Micro-batches method=kd will read (:meth:`moe_lab.core.settings.RunLength.micro_batches`): max_steps x
    accumulate_grad_batches, else max_epochs x epoch length."""
    try:
        return RunLength.given(trainer_cfg).micro_batches(per_epoch)
    except ValueError:
        raise ValueError("task=teacher_logits needs the length of the distillation run: set task.trainer.max_steps "
                         "(or task.trainer.max_epochs with a dataset of known length)") from None


def limited(length: int | None, limit) -> int | None:
    """Batches Lightning runs of a loader of ``length`` under a ``limit_*_batches`` value (int: at most that
    many; float: that fraction)."""
    if limit is None:
        return length
    if isinstance(limit, int):
        return limit if length is None else min(length, limit)
    return None if length is None else int(length * float(limit))


def train_batches(loader, total: int, per_epoch: int | None = None):
    """``total`` batches of ``loader`` over as many epochs as needed (at most ``per_epoch`` of each), each epoch's
    order set as Lightning does."""
    sampler = getattr(loader, "sampler", None)
    for epoch in itertools.count():
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        seen = 0
        for batch in loader:
            if total == 0 or seen == per_epoch:
                break
            seen += 1
            total -= 1
            yield batch
        if total == 0 or seen == 0:
            return


def _device_count(devices, accelerator: str) -> int:
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    if text in ("-1", "auto"):
        return 1 if accelerator == "cpu" else max(torch.cuda.device_count(), 1)
    return int(text)


def trainer_settings(cfg: DictConfig) -> dict:
    """The distillation run's trainer settings: ``hardware.trainer`` updated by ``task.trainer`` (as finetune)."""
    return {**(to_plain(cfg.hardware.trainer) if "hardware" in cfg else {}), **to_plain(cfg.task.trainer)}


def data_parallel_size(cfg: DictConfig) -> int:
    """W of the distillation run: ``task.world_size``, else devices x num_nodes of its trainer settings."""
    if cfg.task.get("world_size") is not None:
        return int(cfg.task.world_size)
    trainer = trainer_settings(cfg)
    devices = trainer.get("devices", "auto")
    return _device_count(devices, str(trainer.get("accelerator", "auto"))) * int(trainer.get("num_nodes") or 1)


def rank_train_loader(datamodule, world: int, rank: int):
    """The train loader data-parallel ``rank`` of ``world`` builds."""
    if hasattr(datamodule, "data_parallel_shard"):
        datamodule.data_parallel_shard = lambda: (world, rank)
    elif world > 1:
        raise ValueError(f"{type(datamodule).__name__} has no data_parallel_shard(), so its rank shards are unknown: "
                         "record with task.world_size=1 and distil in one process")
    return datamodule.train_dataloader()


def val_batches(datamodule, world: int, rank: int, limit):
    """The batches of one validation run on ``rank``: each val loader in turn, Lightning's ``DistributedSampler``
    share (no shuffling) when ``world`` > 1, at most ``limit`` (limit_val_batches) of each."""
    loaders = datamodule.val_dataloader()
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        if world > 1 and not isinstance(loader.sampler, DistributedSampler) \
                and not isinstance(loader.dataset, IterableDataset):
            loader = DataLoader(loader.dataset, batch_size=loader.batch_size, collate_fn=loader.collate_fn,
                                drop_last=loader.drop_last, sampler=DistributedSampler(
                                    loader.dataset, num_replicas=world, rank=rank, shuffle=False))
        try:
            length = len(loader)
        except TypeError:
            length = None
        yield from itertools.islice(loader, limited(length, limit))


def teacher_logits_task(cfg: DictConfig) -> dict:
    """Write the teacher record; returns a summary with the file, W and the batches and tokens per split."""
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(cfg.seed))
    model_cfg = to_plain(cfg.model)
    teacher_cfg = cfg.method.get("teacher") if "method" in cfg else None
    teacher = load_teacher(teacher_cfg if teacher_cfg is not None else model_cfg)
    tokenizer = load_tokenizer(model_cfg.get("tokenizer") or model_cfg.get("pretrained") or "byte")
    datamodule = instantiate(cfg.dataset, tokenizer=tokenizer)
    datamodule.setup("fit")
    trainer_cfg = trainer_settings(cfg)
    world = data_parallel_size(cfg)
    teacher.to(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    top_k = cfg.task.get("top_k")
    top_k = None if top_k is None else int(top_k)
    val_limit = trainer_cfg.get("limit_val_batches", 1.0)
    train, val = [], []
    for rank in range(world):
        loader = rank_train_loader(datamodule, world, rank)
        try:
            length = len(loader)
        except TypeError:
            length = None
        per_epoch = limited(length, trainer_cfg.get("limit_train_batches"))
        train.append(train_batches(loader, num_batches(trainer_cfg, per_epoch), per_epoch))
        if val_limit != 0:
            val.append(val_batches(datamodule, world, rank, val_limit))
    record = record_run(teacher, train, val, top_k)
    if "train.0.batch_tokens" not in record:
        raise ValueError("task=teacher_logits: the training loader gave no batch; check the dataset")
    counts = {split: (len(record[f"{split}.0.batch_tokens"]) if f"{split}.0.batch_tokens" in record else 0,
                      sum(int(v.sum()) for k, v in record.items() if k.startswith(f"{split}.")
                          and k.endswith(".batch_tokens"))) for split in ("train", "val")}
    path = Path(cfg.task.get("file") or out / "teacher_logits.safetensors")
    recorded_with = {"dataset": to_plain(cfg.dataset), "seed": int(cfg.seed),
                     **{k: trainer_cfg.get(k) for k in ("max_steps", "max_epochs", "accumulate_grad_batches",
                                                        "limit_train_batches", "limit_val_batches")}}
    save_run(record, path, world, top_k, recorded_with)
    summary = {"file": str(path), "world_size": world, "top_k": top_k,
               "batches": counts["train"][0], "tokens": counts["train"][1],
               "val_batches": counts["val"][0], "val_tokens": counts["val"][1],
               "override": f"method.options.teacher_logits={path}"}
    atomic_write_json(out / "summary.json", summary, indent=2)
    val = (f"{counts['val'][0]} validation batches per rank" if counts["val"][0] else
           "no validation batches (the run's KD validation will be skipped)")
    print(f"==== moe-lab teacher_logits: {world} data-parallel rank(s) x {counts['train'][0]} train batches "
          f"({counts['train'][1]} tokens), {val} -> {path}\n"
          f"distil with: method=kd method.options.teacher_logits={path} (same dataset, seed, task.trainer and "
          f"hardware overrides: {world} data-parallel rank(s))", flush=True)
    return summary
