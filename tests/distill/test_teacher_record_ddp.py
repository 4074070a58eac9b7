"""A teacher record for 2 data-parallel ranks, and a 2-process (gloo) method=kd run from it.

Oracles: (1) each rank's order written out by hand (``DistributedSampler``'s rule: ``randperm`` seeded
``seed + epoch``, rank r takes every 2nd index from r; validation unshuffled, rank r takes blocks r, r + 2) and the
live teacher's logits of those batches: the record's rows are bit-identical. (2) A 2-process run of ``run.py
hardware=ddp_cpu`` with the live teacher: the run from the record ends with the same weights, to the rounding of
the two KD arithmetics (every fed batch is checked against the record's checksums, so the run itself completing
shows each rank read its own section).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.data.tokenizer import load_tokenizer
from moe_lab.distill.teacher import load_teacher
from moe_lab.distill.teacher_logits import load, load_metadata
from moe_lab.models import load_model
from moe_lab.tasks import run_task
from tests.conftest import ROOT
from tests.distill.test_teacher_record_run import kd_cfg, weights

pytestmark = pytest.mark.slow

# 8 train blocks: 4 per rank, 2 batches of 2 an epoch; 3 steps cross into epoch 1. 4 val blocks: 1 batch a rank.
DDP = ("hardware=ddp_cpu", "dataset.num_blocks=8", "task.trainer.max_steps=3", "task.trainer.accumulate_grad_batches=1",
       "task.trainer.limit_val_batches=1", "task.optim.eps=1.0", "task.optim.weight_decay=0.0",
       "task.optim.lr=1.0", "task.checkpoint_every_n_steps=3", "task.keep_last_checkpoints=0")


def _hydra(value) -> str:
    """``value`` in Hydra's override grammar."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _run_py(cfg, out, *overrides):
    teacher = OmegaConf.to_container(cfg.method.teacher, resolve=True)
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    args = [f"dataset.path={cfg.dataset.path}", f"dataset.val_path={cfg.dataset.val_path}",
            f"method.teacher={_hydra(teacher)}", f"hydra.run.dir={out}", *overrides]
    from tests.distill.test_teacher_record_run import COMMON

    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *COMMON, *DDP, *args], cwd=out.parent, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _rank_batches(blocks: torch.Tensor, order: list[int], rank: int) -> list[torch.Tensor]:
    mine = order[rank::2]
    return [blocks[mine[i:i + 2]] for i in range(0, len(mine), 2)]


def test_two_rank_record_and_ddp_run(tmp_path):
    cfg = kd_cfg(tmp_path, tmp_path / "rec", "task=teacher_logits", *DDP)
    summary = run_task(cfg)
    assert (summary["world_size"], summary["batches"], summary["val_batches"]) == (2, 3, 1)
    assert load_metadata(summary["file"])["world_size"] == 2
    record = load(summary["file"])

    # (1) the rows of each rank's batches, in that rank's order
    from hydra.utils import instantiate

    datamodule = instantiate(cfg.dataset, tokenizer=load_tokenizer("byte"))
    datamodule.setup("fit")
    train, val = datamodule.blocks["train"], datamodule.blocks["val"]
    orders = [torch.randperm(8, generator=torch.Generator().manual_seed(epoch)).tolist() for epoch in (0, 1)]
    teacher = load_teacher(cfg.method.teacher)
    for rank in (0, 1):
        batches = (_rank_batches(train, orders[0], rank) + _rank_batches(train, orders[1], rank))[:3]
        with torch.no_grad():
            rows = torch.cat([teacher(input_ids=b, attention_mask=torch.ones_like(b)).logits.flatten(0, 1)
                              for b in batches])
            val_rows = teacher(input_ids=val[[rank, rank + 2]], attention_mask=torch.ones(2, 16, dtype=torch.long)).logits.flatten(0, 1)
        assert torch.equal(record[f"train.{rank}.logits"], rows)
        assert torch.equal(record[f"val.{rank}.logits"], val_rows)
    assert not torch.equal(record["train.0.logits"], record["train.1.logits"])

    # (2) 2-process runs: from the record, and with the live teacher
    _run_py(cfg, tmp_path / "from_record", f"method.options.teacher_logits={summary['file']}")
    _run_py(cfg, tmp_path / "live")
    a, b = weights(tmp_path / "from_record"), weights(tmp_path / "live")
    assert a.keys() == b.keys()
    L.seed_everything(cfg.seed)  # as finetune builds the student
    init = load_model(cfg.model)[0].state_dict()
    # AdamW with eps = 1 and |g| << 1: an update u is ~lr * m_hat. The runs' gradients differ by the rounding of
    # the two KD arithmetics over the 64 tokens of a global batch (|du| <= fp32 eps x 64 x |u|, |u| <= the
    # whole movement), and w + u rounds to within 1 ulp(w): per step and tensor, ulp(max|w|) + eps x 64 x move
    eps, moved = torch.finfo(torch.float32).eps, 0
    for key, value in a.items():
        move = float((value - init[key[len("model."):]]).abs().max())
        tol = 3 * eps * (float(value.abs().max()) + 64 * move)
        assert float((value - b[key]).abs().max()) <= tol, key
        moved += move > 1000 * tol
    assert moved >= len(a) // 2  # most tensors moved far beyond the tolerance: a wrong teacher row would show
    val = [json.loads((tmp_path / run / "summary.json").read_text())["val/loss"] for run in ("from_record", "live")]
    # validation (step 2, each rank its own val section): the divergence sums terms of size ~log V per token
    assert abs(val[0] - val[1]) <= 8 * eps * math.log(384)
