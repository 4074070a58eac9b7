"""Learning-rate schedules against HF's (transformers.optimization, an independent implementation), step by
step, and as a Lightning run applies them: epoch-based runs reach 0 exactly after the last optimizer step."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import transformers
from torch.utils.data import DataLoader, IterableDataset

from moe_lab.methods.base import MoELightningModule
from moe_lab.methods.schedules import lr_multiplier, warmup_steps_for
from tests.conftest import build_tiny, random_batch


def _hf_lrs(factory, total: int, **kwargs) -> list[float]:
    """The multiplier HF's LambdaLR applies at each optimizer step 0..total (base lr 1)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = factory(opt, **kwargs)
    lrs = []
    for _ in range(total + 1):
        lrs.append(scheduler.get_last_lr()[0])
        opt.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("total,warmup", [(100, 10), (37, 0), (7, 3), (1, 0), (12, 12)])
def test_schedules_equal_hf_step_by_step(total, warmup):
    cases = {
        ("cosine", 0.0): (transformers.get_cosine_schedule_with_warmup,
                          {"num_warmup_steps": warmup, "num_training_steps": total}),
        ("cosine", 0.1): (transformers.get_cosine_with_min_lr_schedule_with_warmup,
                          {"num_warmup_steps": warmup, "num_training_steps": total, "min_lr_rate": 0.1}),
        ("linear", 0.0): (transformers.get_linear_schedule_with_warmup,
                          {"num_warmup_steps": warmup, "num_training_steps": total}),
        ("constant", 0.0): (transformers.get_constant_schedule_with_warmup, {"num_warmup_steps": warmup}),
    }
    for (name, floor), (factory, kwargs) in cases.items():
        expected = _hf_lrs(factory, total, **kwargs)
        got = [lr_multiplier(s, total, name, warmup_steps=warmup, min_lr_ratio=floor) for s in range(total + 1)]
        assert got == expected, (name, floor)
    if warmup < total:  # after the last optimizer step the rate is 0
        assert lr_multiplier(total, total, "cosine", warmup) == lr_multiplier(total, total, "linear", warmup) == 0.0


def test_linear_floor_and_bad_names():
    assert lr_multiplier(10, 10, "linear", min_lr_ratio=0.2) == pytest.approx(0.2)
    assert lr_multiplier(5, 10, "linear", min_lr_ratio=0.2) == pytest.approx(0.2 + 0.8 * 0.5)
    with pytest.raises(ValueError, match="task.scheduler.name='cosin'"):
        lr_multiplier(0, 10, "cosin")
    with pytest.raises(ValueError, match="task.scheduler.warmup_ratio=1.5"):
        warmup_steps_for(10, warmup_ratio=1.5)


@pytest.mark.parametrize("total,ratio", [(100, 0.03), (100, 0.1), (37, 0.05), (300, 0.0), (7, 0.5)])
def test_warmup_ratio_is_hf_ceil(total, ratio, tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), warmup_steps=ratio, report_to=[])
    assert warmup_steps_for(total, warmup_steps=50, warmup_ratio=ratio) == args.get_warmup_steps(total)
    assert warmup_steps_for(total, warmup_steps=5) == 5


class _Record(L.Callback):
    def __init__(self):
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_epoch_based_run_decays_to_zero_at_the_end(name):
    lr = 1e-3
    module = MoELightningModule(build_tiny("olmoe"), "sft", optim={"lr": lr},
                                scheduler={"name": name, "warmup_ratio": 0.25, "warmup_steps": 99})
    record = _Record()
    trainer = L.Trainer(max_epochs=2, max_steps=-1, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", callbacks=[record])
    batches = [random_batch(batch=2, seq=6, seed=s) for s in range(5)]
    trainer.fit(module, DataLoader(batches, batch_size=None))
    steps = len(record.lrs)
    assert steps == trainer.global_step == 6  # ceil(5 / 2) optimizer steps per epoch
    factory = {"cosine": transformers.get_cosine_schedule_with_warmup,
               "linear": transformers.get_linear_schedule_with_warmup}[name]
    expected = _hf_lrs(factory, steps, num_warmup_steps=math.ceil(0.25 * steps), num_training_steps=steps)
    assert record.lrs == [lr * m for m in expected[:-1]]
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == 0.0


class _Endless(IterableDataset):
    def __iter__(self):
        while True:
            yield random_batch(batch=2, seq=6)


def test_decaying_schedule_without_a_step_count_names_the_fix():
    module = MoELightningModule(build_tiny("olmoe"), "sft", scheduler={"name": "cosine"})
    trainer = L.Trainer(max_epochs=-1, max_steps=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with pytest.raises(ValueError, match="task.trainer.max_steps"):
        trainer.fit(module, DataLoader(_Endless(), batch_size=None))
