"""Precomputed teacher logits (for hardware where teacher and student cannot share one engine).

``record_teacher(teacher, batches, top_k=None)`` runs the teacher once and keeps, for every real token in batch
order, either the full logits (``top_k=None``) or the top-k logits with their indices and the log-sum-exp of
the full row. ``kd_loss_from_record`` is KD against such rows: exact for full logits (any kind); for top-k
(forward KL only) the teacher distribution is truncated to its k largest probabilities p_T(v) = exp(z_v - lse),
true values, the tail mass 1 - sum dropped: sum_{v in top-k} p_T(v) (log p_T(v) - log p_S(v)), which equals the
full forward KL when the tail mass is 0 and otherwise differs from it by the tail's contribution.

A run's record (``task=teacher_logits``, read by method=kd through ``RecordedTeacher``) is one safetensors file
with a section per split and data-parallel rank, in the order that rank reads its batches::

    <split>.<rank>.logits | .values .indices .lse   the rows (real tokens, batch after batch)
    <split>.<rank>.batch_tokens    int64 [B]        real tokens of each batch
    <split>.<rank>.batch_shape     int64 [B, 2]     rows and width of each batch's input_ids
    <split>.<rank>.batch_checksum  int64 [B]        ``batch_checksum(input_ids)`` of each batch

split is ``train`` (every micro-batch of the run) or ``val`` (the batches of one validation run; optional). The
header metadata ``moe_lab`` (JSON) holds ``format``, ``world_size`` (the data-parallel size W the sections are
for), ``top_k`` and ``recorded_with`` (the dataset config and loop settings, quoted in mismatch errors).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterable
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..core.atomic import atomic_write
from ..core.plain import to_plain
from .losses import _mask, token_divergence

log = logging.getLogger(__name__)

FORMAT = "moe_lab.teacher_logits/2"
SPLITS = ("train", "val")
ROW_KEYS = ("logits", "values", "indices", "lse")


@torch.no_grad()
def record_teacher(teacher, batches, top_k: int | None = None) -> dict[str, torch.Tensor]:
    """Teacher logits of the real tokens of ``batches`` (padded: input_ids + attention_mask; packed: as
    ``data.packing.model_inputs`` reads them, the teacher seeing what method=kd gives it), in order."""
    from ..data.packing import model_inputs, real_token_mask

    device = next(teacher.parameters()).device
    rows = []
    for batch in batches:
        mask = real_token_mask(batch).bool().to(device)
        inputs = model_inputs({"labels": None, **batch})
        inputs.pop("labels")
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        rows.append(teacher(**inputs).logits.float()[mask].cpu())
    logits = torch.cat(rows)
    if top_k is None:
        return {"logits": logits}
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"teacher_logits top_k={top_k} must be between 1 and the vocabulary {logits.shape[-1]}")
    values, indices = logits.topk(top_k, dim=-1)
    return {"values": values, "indices": indices, "lse": torch.logsumexp(logits, dim=-1)}


def batch_checksum(input_ids: torch.Tensor) -> int:
    """A 64-bit BLAKE2b digest of a batch's token ids and shape (as a signed int64)."""
    ids = input_ids.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.blake2b(ids.numpy().tobytes(), digest_size=8)
    digest.update(repr(tuple(ids.shape)).encode())
    return int.from_bytes(digest.digest(), "little", signed=True)


def record_section(teacher, batches: Iterable[dict], top_k: int | None = None) -> dict[str, torch.Tensor]:
    """``record_teacher`` rows of ``batches`` plus each batch's ``batch_tokens``, ``batch_shape`` and
    ``batch_checksum``; ``{}`` when there are no batches."""
    from ..data.packing import real_token_mask

    tokens, shapes, sums = [], [], []

    def watched():
        for batch in batches:
            tokens.append(int(real_token_mask(batch).sum()))
            shapes.append(tuple(batch["input_ids"].shape))
            sums.append(batch_checksum(batch["input_ids"]))
            yield batch

    stream = watched()
    first = next(stream, None)
    if first is None:
        return {}
    rows = record_teacher(teacher, itertools.chain([first], stream), top_k)
    return {**rows, "batch_tokens": torch.tensor(tokens, dtype=torch.int64),
            "batch_shape": torch.tensor(shapes, dtype=torch.int64).reshape(-1, 2),
            "batch_checksum": torch.tensor(sums, dtype=torch.int64)}


def record_run(teacher, train_shards, val_shards=(), top_k: int | None = None) -> dict[str, torch.Tensor]:
    """The sections of a run record: ``train_shards[r]`` (``val_shards[r]``) are rank r's batches in the order
    it reads them; a rank without val batches gets no val section."""
    record = {}
    for split, shards in (("train", train_shards), ("val", val_shards)):
        for rank, batches in enumerate(shards):
            record.update({f"{split}.{rank}.{k}": v for k, v in record_section(teacher, batches, top_k).items()})
    return record


def save_run(record: dict[str, torch.Tensor], path, world_size: int, top_k: int | None = None,
             recorded_with: dict | None = None) -> None:
    """Write a ``record_run`` record for ``world_size`` data-parallel ranks (``recorded_with``: the settings
    quoted when a run's batches differ)."""
    save(record, path, {"format": FORMAT, "world_size": int(world_size), "top_k": top_k,
                        "recorded_with": recorded_with or {}})


def save(record: dict[str, torch.Tensor], path, metadata: dict | None = None) -> None:
    """Write ``record`` to a safetensors file atomically; ``metadata`` (JSON-able) goes into the header as ``moe_lab``."""
    header = None if metadata is None else {"moe_lab": json.dumps(metadata)}
    tensors = {k: v.contiguous() for k, v in record.items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=header))


def load(path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def load_metadata(path) -> dict:
    """The ``moe_lab`` header of a record file (``{}`` when it has none)."""
    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("moe_lab", "{}"))


def kd_loss_from_record(student_logits: torch.Tensor, record: dict[str, torch.Tensor], kind: str = "forward_kl",
                        temperature: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean KD over the real tokens of ``student_logits`` against a teacher record of the same tokens."""
    s = student_logits.reshape(-1, student_logits.shape[-1])
    s = s[_mask(mask, s.shape[0], s.device)]
    if "logits" in record:
        t = record["logits"].to(s.device)
        if t.shape != s.shape:
            raise ValueError(f"teacher record holds {tuple(t.shape)} logits for {tuple(s.shape)} student tokens")
        return token_divergence(s, t, kind, temperature).mean()
    if kind != "forward_kl" or temperature != 1.0:
        raise ValueError("a top-k teacher record supports forward_kl at temperature 1 only (record full logits)")
    values, indices, lse = (record[k].to(s.device) for k in ("values", "indices", "lse"))
    if values.shape[0] != s.shape[0]:
        raise ValueError(f"teacher record holds {values.shape[0]} tokens, the student batch {s.shape[0]}")
    log_p_t = values - lse[:, None]
    log_p_s = F.log_softmax(s.float(), dim=-1).gather(1, indices)
    return (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1).mean()


@contextmanager
def _readable(path, option: str):
    """A record file that safetensors cannot read (truncated: a kill or a full disk while it was copied) is named
    with the option that gave it and the fix, instead of a bare ``SafetensorError``."""
    try:
        yield
    except SafetensorError as err:
        raise ValueError(f"{option}={path}: the teacher record is truncated or corrupted (safetensors: {err}). "
                         "Write it again with python run.py task=teacher_logits (the same dataset, seed and "
                         f"task.trainer overrides as this run) and point {option} at the new file") from None


class RecordedTeacher:
    """A run's teacher record (``task=teacher_logits``) as one data-parallel rank reads it: a batch cursor per
    split, and every batch checked (token count, shape, checksum) against the one recorded there.

    ``bind(world_size, rank)`` loads that rank's sections (refused for a record of another W); ``next(split,
    input_ids, n_tokens)`` returns the next batch's rows; ``restart("val")`` at every validation run;
    ``state_dict()``/``load_state_dict()`` carry the train cursor through a checkpoint.
    """

    def __init__(self, path, option: str = "method.options.teacher_logits"):
        self.path, self.option = str(path), option
        with _readable(path, option):
            meta = load_metadata(path)
        if meta.get("format") != FORMAT:
            raise ValueError(f"{option}={path} is not a run record with batch checksums ({FORMAT}); write it with "
                             "python run.py task=teacher_logits (same dataset, seed and task.trainer overrides)")
        self.world_size, self.top_k = int(meta["world_size"]), meta.get("top_k")
        self.recorded_with = meta.get("recorded_with") or {}
        with _readable(path, option), safe_open(self.path, "pt") as f:
            keys = set(f.keys())
            self.splits = tuple(s for s in SPLITS if f"{s}.0.batch_tokens" in keys)
            self.vocab = f.get_slice("train.0.logits").get_shape()[-1] if "train.0.logits" in keys else None
        if "train" not in self.splits:
            raise ValueError(f"{option}={path} has no train section: write it with python run.py task=teacher_logits")
        self.rank: int | None = None
        self.sections: dict[str, dict[str, torch.Tensor]] = {}
        self.cursor = {s: 0 for s in SPLITS}

    def bind(self, world_size: int, rank: int) -> None:
        """Load the sections of data-parallel ``rank`` of ``world_size`` (once)."""
        if self.rank == rank:
            return
        if world_size != self.world_size:
            raise ValueError(f"{self.option}={self.path} was recorded for {self.world_size} data-parallel rank(s); "
                             f"this run has {world_size}: record it again with task=teacher_logits under this "
                             f"run's hardware (or task.world_size={world_size})")
        with _readable(self.path, self.option), safe_open(self.path, "pt") as f:
            keys = list(f.keys())
            for split in self.splits:
                prefix = f"{split}.{rank}."
                self.sections[split] = {k[len(prefix):]: f.get_tensor(k) for k in keys if k.startswith(prefix)}
                tokens = self.sections[split]["batch_tokens"]
                self.sections[split]["starts"] = torch.cat([tokens.new_zeros(1), tokens.cumsum(0)])
        self.rank = rank

    def split_for(self, trainer) -> str | None:
        """Bind to ``trainer``'s data-parallel rank (no trainer: one process) and name the split its stage reads:
        ``"val"`` while validating or sanity checking, else ``"train"``; ``None`` for validation without a val
        section. Such a record switches the trainer's validation off (``limit_val_batches = 0``) the first time,
        with one log line."""
        shard = trainer.distributed_sampler_kwargs if trainer is not None else None
        self.bind(*((int(shard["num_replicas"]), int(shard["rank"])) if shard else (1, 0)))
        if trainer is None:
            return "train"
        if not self.has("val") and trainer.limit_val_batches:
            trainer.limit_val_batches = 0
            if sum(trainer.num_val_batches or [0]):  # there was validation data to skip
                log.info("%s=%s has no validation batches (recorded with limit_val_batches=0 or without "
                         "validation data): KD validation skipped", self.option, self.path)
        if trainer.validating or trainer.sanity_checking:
            return "val" if self.has("val") else None
        return "train"

    def has(self, split: str) -> bool:
        return split in self.splits

    def restart(self, split: str) -> None:
        self.cursor[split] = 0

    def position(self, split: str) -> int:
        """Token offset of the cursor in this rank's ``split`` rows."""
        return int(self.sections[split]["starts"][self.cursor[split]])

    def next(self, split: str, input_ids: torch.Tensor, n_tokens: int, datamodule=None) -> dict[str, torch.Tensor]:
        """Rows of the next recorded ``split`` batch, after checking it is this batch (``datamodule``: named in
        the error when its settings differ from the recorded ones)."""
        section, b = self.sections[split], self.cursor[split]
        count = section["batch_tokens"].shape[0]
        if b >= count:
            fix = ("task.trainer.max_steps / max_epochs / accumulate_grad_batches" if split == "train"
                   else "task.trainer.limit_val_batches")
            raise ValueError(f"{self.option}={self.path} holds {count} {split} batches for rank {self.rank}; the "
                             f"run reads batch {b + 1}: record it again with this run's {fix}")
        shape = tuple(input_ids.shape)
        want = (int(section["batch_tokens"][b]), tuple(section["batch_shape"][b].tolist()),
                int(section["batch_checksum"][b]))
        if want[:2] != (n_tokens, shape) or want[2] != batch_checksum(input_ids):
            raise ValueError(self._mismatch(split, b, want, (n_tokens, shape), datamodule))
        self.cursor[split] = b + 1
        start, end = int(section["starts"][b]), int(section["starts"][b + 1])
        return {k: section[k][start:end] for k in ROW_KEYS if k in section}

    def _mismatch(self, split, b, want, got, datamodule) -> str:
        if want[1] != got[1]:
            what = (f"recorded {want[1][0]} rows x {want[1][1]} tokens, this run's batch {got[1][0]} x {got[1][1]} "
                    "(another dataset.batch_size or sequence length)")
        elif want[0] != got[0]:
            what = f"recorded {want[0]} real tokens, this run's batch {got[0]} (other data)"
        else:
            what = "same shape and token count, other token ids (other data, data order or seed)"
        dataset = self.recorded_with.get("dataset") or {}
        diffs = [f"dataset.{k}: recorded {v!r}, this run {getattr(datamodule, k)!r}" for k, v in dataset.items()
                 if datamodule is not None and not k.startswith("_") and hasattr(datamodule, k)
                 and _differs(to_plain(getattr(datamodule, k)), v)]
        settings = ", ".join(f"{k}={v}" for k, v in self.recorded_with.items() if k != "dataset")
        return (f"{self.option}={self.path}: {split} batch {b + 1} of rank {self.rank} is not the recorded one: "
                f"{what}. " + (f"Differs: {'; '.join(diffs)}. " if diffs else "")
                + f"Recorded with W={self.world_size}" + (f", {settings}" if settings else "")
                + ". Record again with task=teacher_logits and this run's dataset, seed, task.trainer and hardware "
                "overrides (or distil with the recorded ones)")

    def state_dict(self) -> dict[str, int]:
        """``{"train_batches": b}``: the train batches consumed (the same on every rank)."""
        return {"train_batches": self.cursor["train"]}

    def load_state_dict(self, state: dict) -> None:
        self.cursor["train"] = int(state["train_batches"])



def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor attribute: no verdict
        return False
