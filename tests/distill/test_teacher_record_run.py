"""A method=kd run from a task=teacher_logits record: resume, validation and misaligned data.

Oracles: an uninterrupted run (resume must give the same weights bit for bit); a run whose validation is off
(validation must not touch the training rows, weights bit for bit); the live teacher's logits of the validation
batches the Trainer actually feeds (captured by a callback), KD computed from them with ``kd_loss``.
"""

from __future__ import annotations

import hashlib
import json
import logging

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from moe_lab.data.packing import model_inputs, real_token_mask
from moe_lab.distill import kd_loss
from moe_lab.distill.teacher import load_teacher
from moe_lab.runtime.checkpoint_io import marker_path
from moe_lab.tasks import run_task
from tests.conftest import ROOT, tiny_model_cfg, word_text

# 10 train blocks of 16 tokens, batches of 2: 5 batches an epoch; accumulation 2: steps (b0 b1) (b2 b3) (b4)
# (epoch 1: b0 b1), so step 2 ends mid-epoch; validation (2 batches) after every 2nd batch of the run
COMMON = ("model=tiny_qwen3_moe", "method=kd", "dataset=text", "dataset.block_size=16", "dataset.batch_size=2",
          "dataset.num_blocks=10", "dataset.streaming=false", "dataset.shuffle=true", "dataset.val_split=validation",
          "dataset.val_blocks=4", "task.trainer.max_steps=4", "task.trainer.accumulate_grad_batches=2",
          "task.trainer.val_check_interval=2", "task.trainer.limit_val_batches=2", "task.scheduler.warmup_steps=0",
          "task.scheduler.name=constant", "task.optim.lr=1e-2", "task.export=false", "callbacks=none",
          "logger=none", "task.checkpoint_every_n_steps=2", "task.keep_last_checkpoints=2")
VAL: list[dict] = []


class CaptureVal(L.Callback):
    """Per validation batch: the batch, the student's logits, the KD the module computed (token mean)."""

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        inputs = model_inputs(batch)
        inputs.pop("labels")
        with torch.no_grad():
            logits = pl_module.model(**inputs).logits
        VAL.append({"step": trainer.global_step, "batch": {k: v.clone() for k, v in batch.items()
                                                           if torch.is_tensor(v)}, "student": logits})

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        VAL[-1]["div"] = pl_module.kd_stats["div"]


def kd_cfg(data, out, *overrides):
    """A task config over the data in ``data`` (train.txt, val.txt), run directory ``out``."""
    train = data / "train.txt"
    if not train.exists():
        word_text(train, 8, words_per_line=12)
        word_text(data / "val.txt", 4, words_per_line=12, seed=1)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*COMMON, f"dataset.path={train}", f"dataset.val_path={data / 'val.txt'}",
                                           f"paths.output_dir={out}", *overrides])
    with open_dict(cfg):
        cfg.method.teacher = tiny_model_cfg("qwen3_moe")
        cfg.method.teacher.seed = 1
    return cfg


def weights(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A record with validation batches, one without, and the straight 4-step run from the first."""
    tmp = tmp_path_factory.mktemp("record")
    with_val = run_task(kd_cfg(tmp, tmp / "rec", "task=teacher_logits"))
    no_val = run_task(kd_cfg(tmp, tmp / "rec_noval", "task=teacher_logits", "task.trainer.limit_val_batches=0"))
    assert (with_val["batches"], with_val["val_batches"], with_val["world_size"]) == (8, 2, 1)
    assert no_val["val_batches"] == 0
    run = kd_cfg(tmp, tmp / "straight", "task=finetune", f"method.options.teacher_logits={with_val['file']}")
    with open_dict(run):
        run.callbacks = OmegaConf.create({"capture": {"_target_": f"{__name__}.CaptureVal"}})
    VAL.clear()
    summary = run_task(run)
    assert summary["global_step"] == 4
    return {"tmp": tmp, "file": with_val["file"], "no_val": no_val["file"], "val": list(VAL)}


def test_resume_is_exact(recorded):
    tmp = recorded["tmp"]
    step2 = tmp / "straight" / "checkpoints" / "step-2.ckpt"
    ckpt = torch.load(step2, weights_only=True)
    assert ckpt["moe_lab_kd"]["teacher_logits"] == {"train_batches": 4}  # (b0 b1) (b2 b3)
    run_task(kd_cfg(tmp, tmp / "resumed", "task=finetune", f"method.options.teacher_logits={recorded['file']}",
                    f"task.ckpt_path={step2}"))
    assert_same_weights(weights(tmp / "straight"), weights(tmp / "resumed"))
    # without the cursor the resumed run would restart at the record's first batch: refused
    del ckpt["moe_lab_kd"]["teacher_logits"]
    torch.save(ckpt, tmp / "no_cursor.ckpt")
    marker = json.loads(marker_path(step2).read_text())  # a valid marker: the new file's own content hash
    marker["sha256"] = {"no_cursor.ckpt": hashlib.sha256((tmp / "no_cursor.ckpt").read_bytes()).hexdigest()}
    marker_path(tmp / "no_cursor.ckpt").write_text(json.dumps(marker))
    with pytest.raises(ValueError, match="no teacher-record position"):
        run_task(kd_cfg(tmp, tmp / "resumed2", "task=finetune", f"method.options.teacher_logits={recorded['file']}",
                        f"task.ckpt_path={tmp / 'no_cursor.ckpt'}"))


def test_validation_reads_the_val_section(recorded, caplog):
    tmp = recorded["tmp"]
    # the same training with validation skipped (a record without val batches): the same weights
    with caplog.at_level(logging.INFO, logger="moe_lab.distill.teacher_logits"):
        run_task(kd_cfg(tmp, tmp / "noval", "task=finetune", f"method.options.teacher_logits={recorded['no_val']}"))
    assert sum("KD validation skipped" in r.message for r in caplog.records) == 1
    assert_same_weights(weights(tmp / "straight"), weights(tmp / "noval"))
    # three validation runs (after the run's batches 2, 4 and 6), each over the same 2 val batches
    seen = recorded["val"]
    assert [s["step"] for s in seen] == [1, 1, 2, 2, 3, 3]
    for i, s in enumerate(seen):
        assert torch.equal(s["batch"]["input_ids"], seen[i % 2]["batch"]["input_ids"])
    assert not torch.equal(seen[0]["student"], seen[2]["student"])  # the student moved between them
    teacher = load_teacher(kd_cfg(tmp, tmp / "x").method.teacher)
    for s in seen:
        inputs = model_inputs(s["batch"])
        inputs.pop("labels")
        with torch.no_grad():
            live = teacher(**inputs).logits
        ref = float(kd_loss(s["student"], live, mask=real_token_mask(s["batch"])))
        # the same fp32 divergences; mean vs sum / n may differ in the last bit
        assert abs(s["div"] - ref) <= 4 * torch.finfo(torch.float32).eps * abs(ref)


@pytest.mark.parametrize("override,message", [
    ("dataset.seed=1", r"other token ids .*dataset\.seed: recorded 0, this run 1"),
    ("dataset.batch_size=4", (r"recorded 2 rows x 16 tokens, this run's batch 4 x 16 .*"
                              r"dataset\.batch_size: recorded 2, this run 4")),
])
def test_other_batches_are_refused(recorded, override, message):
    tmp = recorded["tmp"]
    with pytest.raises(ValueError, match=message):
        run_task(kd_cfg(tmp, tmp / override.replace("=", "_"), "task=finetune", override,
                        f"method.options.teacher_logits={recorded['file']}"))


def test_record_for_another_world_size_is_refused(recorded):
    from types import SimpleNamespace

    from moe_lab.distill.teacher_logits import RecordedTeacher

    record = RecordedTeacher(recorded["file"])
    trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})
    with pytest.raises(ValueError, match=r"recorded for 1 data-parallel rank\(s\); this run has 2.*world_size=2"):
        record.split_for(trainer)
