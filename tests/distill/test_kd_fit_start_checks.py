"""method=kd refuses what cannot work at fit start, before any data is read: a teacher record made for another
data-parallel world size, and a KDModule built with ``export_only`` (no teacher).

Oracles: hook and data-loader counters (the loader must never be iterated, ``on_train_start`` never reached);
the same fit with a record for this run's W=1 trains one step (the check refuses only the wrong W); the error text
is RecordedTeacher.bind's (the same message the first batch gave before).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from moe_lab.distill import teacher_logits as tl
from moe_lab.methods.distill import KDModule
from tests.conftest import build_tiny, random_batch

KEYS = ("input_ids", "attention_mask")


class CountingLoader(DataLoader):
    """One pre-made batch per epoch; counts how often the trainer starts iterating it."""

    def __init__(self, batch):
        super().__init__([batch], batch_size=None)
        self.iterations = 0

    def __iter__(self):
        self.iterations += 1
        return super().__iter__()


class Hooks(L.Callback):
    def __init__(self):
        self.seen: list[str] = []

    def on_sanity_check_start(self, trainer, pl_module):
        self.seen.append("sanity")

    def on_train_start(self, trainer, pl_module):
        self.seen.append("train_start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append("batch")


def _setup(batch):
    """A one-step CPU trainer with a hook recorder, and a counting loader over ``batch``."""
    hooks = Hooks()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[hooks])
    return trainer, CountingLoader(batch), hooks


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """W=2 and W=1 records of the same teacher: rank r's batch is random_batch(seed=r)."""
    tmp = tmp_path_factory.mktemp("kd_records")
    teacher = build_tiny("qwen3_moe", seed=0).eval()
    batches = [random_batch(seed=s) for s in (0, 1)]
    shards = [[{k: b[k] for k in KEYS}] for b in batches]
    w2, w1 = tmp / "w2.safetensors", tmp / "w1.safetensors"
    tl.save_run(tl.record_run(teacher, shards), w2, world_size=2)
    tl.save_run(tl.record_run(teacher, shards[:1]), w1, world_size=1)
    return {"w2": str(w2), "w1": str(w1), "batch": batches[0]}


def test_record_for_another_world_size_is_refused_before_any_batch(records):
    module = KDModule(build_tiny("qwen3_moe", seed=1), options={"teacher_logits": records["w2"]})
    trainer, loader, hooks = _setup(records["batch"])
    with pytest.raises(ValueError, match=r"recorded for 2 data-parallel rank\(s\); this run has 1: record it again "
                                         r"with task=teacher_logits .*\(or task.world_size=1\)"):
        trainer.fit(module, train_dataloaders=loader)
    assert loader.iterations == 0 and hooks.seen == [] and trainer.global_step == 0


def test_record_for_this_world_size_trains(records):
    """The control: the same fit against the W=1 record reads the batch and takes its step."""
    module = KDModule(build_tiny("qwen3_moe", seed=1), options={"teacher_logits": records["w1"]})
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer, loader, hooks = _setup(records["batch"])
    trainer.fit(module, train_dataloaders=loader)
    assert (trainer.global_step, loader.iterations, hooks.seen) == (1, 1, ["train_start", "batch"])
    assert module.record.rank == 0 and module.record.cursor["train"] == 1
    assert any(not torch.equal(p, before[n]) for n, p in module.model.named_parameters())


def test_export_only_loads_no_teacher_and_refuses_to_train(tmp_path, records):
    """export_only: neither the teacher (a path that does not exist) nor the record (deleted) is opened; the
    student's weights are those given; a fit is refused before any data is read."""
    student = build_tiny("qwen3_moe", seed=1)
    expected = {k: v.clone() for k, v in student.state_dict().items()}
    for teacher, options in ((str(tmp_path / "gone"), None),
                             (None, {"teacher_logits": str(tmp_path / "gone.safetensors")}),
                             (str(tmp_path / "gone"), {"teacher_top_k": 4})):
        with pytest.raises((OSError, ValueError)):  # without export_only the missing teacher / record is opened
            KDModule(build_tiny("qwen3_moe", seed=1), teacher=teacher, options=options)
        module = KDModule(student, teacher=teacher, options=options, export_only=True)
        assert module.teacher is None and module.record is None and module.teacher_patch is None
        state = module.model.state_dict()
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
    trainer, loader, hooks = _setup(records["batch"])
    with pytest.raises(ValueError, match=r"export_only=True\) has no teacher.*cannot train"):
        trainer.fit(module, train_dataloaders=loader)
    assert loader.iterations == 0 and hooks.seen == []
