"""val/loss and val/ppl under 2-process gloo DDP: torchmetrics' token-weighted mean over both ranks' batches.

Oracle: the summed token NLL of every rank's batches (``F.cross_entropy(reduction="sum")`` on the logits,
labels shifted by hand) divided by the number of supervised tokens, computed in this process on the same
batches each rank sees (DistributedSampler without shuffling: rank r gets rows r, r + 2, ...).
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from moe_lab.methods.base import MoELightningModule
from tests.conftest import build_tiny

pytestmark = pytest.mark.slow

ROWS, SEQ, BATCH = 8, 12, 2


def _rows() -> list[dict]:
    """Rows with very different numbers of supervised tokens, so an unweighted mean would differ."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(ROWS):
        ids = torch.randint(3, 300, (SEQ,), generator=g)
        keep = [SEQ, 3, 11, 4, 9, 2, 12, 5][i]
        mask = (torch.arange(SEQ) < keep).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[: [0, 0, 4, 0, 1, 0, 8, 0][i]] = -100  # a prompt part without labels
        rows.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels})
    return rows


def _oracle(model, rows) -> tuple[float, float]:
    nll, count = 0.0, 0
    with torch.no_grad():
        for rank in range(2):
            mine = rows[rank::2]
            for start in range(0, len(mine), BATCH):
                batch = {k: torch.stack([r[k] for r in mine[start : start + BATCH]]) for k in mine[0]}
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                target = batch["labels"][:, 1:]
                nll += float(F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), target.flatten(),
                                             ignore_index=-100, reduction="sum"))
                count += int((target != -100).sum())
    return nll / count, count


def test_val_loss_is_token_weighted_mean_over_both_ranks():
    torch.manual_seed(0)
    module = MoELightningModule(build_tiny("olmoe"), method="sft")
    rows = _rows()
    expected, tokens = _oracle(module.model.eval(), rows)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    (result,) = trainer.validate(module, torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False))
    # the rank batches run the same fp32 matmuls as the oracle's; what differs is the order of the
    # reductions (HF's mean x count vs one fp64 sum): |error| <= fp32 eps x tokens x loss
    tol = torch.finfo(torch.float32).eps * tokens * expected
    assert result["val/loss"] == pytest.approx(expected, abs=tol)
    assert result["val/ppl"] == pytest.approx(math.exp(expected), rel=2 * tol)
    # the unweighted mean of the batch losses is far from it: the weighting is what the test checks
    per_batch = []
    with torch.no_grad():
        for rank in range(2):
            mine = rows[rank::2]
            for start in range(0, len(mine), BATCH):
                batch = {k: torch.stack([r[k] for r in mine[start : start + BATCH]]) for k in mine[0]}
                per_batch.append(float(module.model(**batch).loss))
    assert abs(sum(per_batch) / len(per_batch) - expected) > 100 * tol
