"""val/loss and val/ppl are the language-model token CE alone, whatever the aux-loss coefficient; the training
objective keeps the aux term and ``train/lm_loss`` logs its CE part.

Oracle: ``F.cross_entropy(reduction="sum")`` over the shifted labels of logits from a forward without labels
(so no aux term can enter), summed over the validation batches and divided by their supervised tokens.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from moe_lab.methods.base import MoELightningModule
from moe_lab.moe.aux_loss import added_aux_loss
from tests.conftest import FAMILIES, build_tiny, random_batch

COEF = 10.0  # large, so CE + coef * aux is far from the CE


def _batches() -> list[dict]:
    """Batches with different supervised-token counts (a prompt part without labels in one)."""
    first = random_batch(batch=3, seq=10, seed=0)
    second = random_batch(batch=2, seq=7, seed=1, pad_rows=((1, 2),))
    second["labels"][:, :3] = -100
    return [first, second]


def _trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False)


def _hand_ce(model, batches) -> tuple[float, int]:
    """Summed token NLL (fp64) and supervised-token count, from logits of label-free forwards."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            target = batch["labels"][:, 1:]
            nll += float(F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), target.flatten(),
                                         ignore_index=-100, reduction="sum"))
            count += int((target != -100).sum())
    return nll, count


@pytest.mark.parametrize("family", FAMILIES)
def test_val_loss_is_token_ce_without_aux(family):
    torch.manual_seed(0)
    module = MoELightningModule(build_tiny(family), method="sft", aux_loss_coef=COEF)
    batches = _batches()
    nll, tokens = _hand_ce(module.model.eval(), batches)
    expected = nll / tokens
    objective = 0.0  # what val/loss was before the fix: the training objective, CE + coef * aux
    with torch.no_grad():
        for batch in batches:
            objective += float(module._step(batch, "train")) * int((batch["labels"][:, 1:] != -100).sum())
    (result,) = _trainer().validate(module, torch.utils.data.DataLoader(batches, batch_size=None))
    # same fp32 forward as the oracle; only the reduction order differs: |error| <= fp32 eps x tokens x loss
    tol = torch.finfo(torch.float32).eps * tokens * expected
    assert result["val/loss"] == pytest.approx(expected, abs=tol)
    assert result["val/ppl"] == pytest.approx(math.exp(expected), rel=2 * tol)
    assert result["val/aux_loss"] > 0  # the aux loss is still computed and logged, apart
    # the old value is far from it: the test can fail
    assert abs(objective / tokens - expected) > 1e3 * tol


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])  # aux from HF / aux added by moe-lab
def test_training_objective_keeps_aux_and_logs_lm_loss(family):
    model = build_tiny(family)
    module = MoELightningModule(model, method="sft", aux_loss_coef=COEF, optim={"lr": 0.0})
    batch = random_batch()
    batch["labels"][:, :4] = -100
    nll, tokens = _hand_ce(model.eval(), [batch])
    model.train()
    with torch.no_grad():
        loss = module._step(batch, "train")
        out = model(**batch)
    if module._moe_lab_adds_aux:
        aux = added_aux_loss(module.patch, out.router_logits, batch["attention_mask"])
        objective = out.loss + COEF * aux
    else:  # HF's own loss with labels: CE + router_aux_loss_coef * aux, bit for bit
        objective = out.loss
    assert model.config.output_router_logits and torch.equal(loss, objective)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, max_steps=1,
                        limit_val_batches=0)
    trainer.fit(module, torch.utils.data.DataLoader([batch], batch_size=None))
    tol = torch.finfo(torch.float32).eps * tokens * nll / tokens
    assert float(trainer.callback_metrics["train/lm_loss"]) == pytest.approx(nll / tokens, abs=tol)
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(float(objective), rel=1e-6)
