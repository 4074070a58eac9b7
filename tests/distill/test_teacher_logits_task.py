"""task=teacher_logits writes the teacher's logits in the order a method=kd run reads its batches.

Oracle: the batches the Lightning Trainer of a real method=kd run actually feeds (captured by a callback, not the
task's own iteration), over two shuffled epochs: the record rows consumed for each batch are bit-identical to the
live teacher's logits of that batch, and the KD the run computes from the file equals KD against the live teacher.
"""

from __future__ import annotations

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from moe_lab.data.packing import model_inputs, real_token_mask
from moe_lab.distill import kd_loss
from moe_lab.distill.teacher import load_teacher
from tests.conftest import ROOT, tiny_model_cfg, word_text

SEEN: list[dict] = []


class Capture(L.Callback):
    """Keeps, per micro-batch: the batch, the record offset, the student's logits before the step, KD stats."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        inputs = model_inputs(batch)
        inputs.pop("labels")
        with torch.no_grad():
            logits = pl_module.model(**inputs).logits
        pl_module.record.split_for(trainer)  # binds the record to this rank (the module does it at its first batch)
        SEEN.append({"batch": {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()},
                     "offset": pl_module.record.position("train"),
                     "student": logits})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        SEEN[-1]["div"] = pl_module.kd_stats["div"]


def _cfg(tmp_path, *overrides):
    train = word_text(tmp_path / "train.txt", 8, words_per_line=12)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "model=tiny_qwen3_moe", "method=kd", "dataset=text", f"dataset.path={train}", "dataset.block_size=16",
            "dataset.batch_size=2", "dataset.num_blocks=4", "dataset.streaming=false", "dataset.shuffle=true",
            "task.trainer.max_steps=3", "task.scheduler.warmup_steps=0", "task.export=false", "callbacks=none",
            "logger=none", *overrides])
    with open_dict(cfg):
        cfg.method.teacher = tiny_model_cfg("qwen3_moe")
        cfg.method.teacher.seed = 1
    return cfg


def test_record_follows_the_kd_run(tmp_path):
    from moe_lab.tasks import run_task

    cfg = _cfg(tmp_path, "task=teacher_logits", f"paths.output_dir={tmp_path / 'rec'}")
    summary = run_task(cfg)
    assert summary["batches"] == 3 and summary["tokens"] == 3 * 2 * 16
    run = _cfg(tmp_path, "task=finetune", f"paths.output_dir={tmp_path / 'kd'}",
               f"method.options.teacher_logits={summary['file']}")
    with open_dict(run):
        run.callbacks = OmegaConf.create({"capture": {"_target_": f"{__name__}.Capture"}})
    SEEN.clear()
    run_task(run)
    assert len(SEEN) == 3
    epoch0 = torch.cat([s["batch"]["input_ids"] for s in SEEN[:2]])
    assert not torch.equal(SEEN[2]["batch"]["input_ids"], epoch0[:2])  # epoch 1 is shuffled differently
    teacher = load_teacher(cfg.method.teacher)
    from moe_lab.distill.teacher_logits import load

    record = load(summary["file"])["train.0.logits"]
    for seen in SEEN:
        inputs = model_inputs(seen["batch"])
        inputs.pop("labels")
        mask = real_token_mask(seen["batch"])
        with torch.no_grad():
            live = teacher(**inputs).logits
        n = int(mask.sum())
        assert torch.equal(record[seen["offset"]:seen["offset"] + n], live[mask.bool()])
        ref = float(kd_loss(seen["student"], live, mask=mask))
        # the same fp32 divergences; mean vs sum / n may differ in the last bit
        assert abs(seen["div"] - ref) <= 4 * torch.finfo(torch.float32).eps * abs(ref)


def test_world_size_and_epoch_limits():
    from moe_lab.tasks.teacher_logits import data_parallel_size, limited, train_batches

    def world(*overrides):
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            return data_parallel_size(compose("config", overrides=["task=teacher_logits", *overrides]))

    assert world() == 1 and world("hardware=ddp_cpu") == 2
    assert world("hardware=ddp_cpu", "+task.trainer.num_nodes=3") == 6
    assert world("hardware=ddp_cpu", "+task.trainer.devices=[0,1,2]") == 3
    assert world("hardware=ddp_cpu", "task.world_size=8") == 8
    assert (limited(5, None), limited(5, 2), limited(5, 9), limited(5, 0.5), limited(None, 3)) == (5, 2, 5, 2, 3)
    # 2 batches an epoch (limit_train_batches), reshuffled per epoch like Lightning: independent order by hand
    data = torch.arange(8)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    got = [b.tolist() for b in train_batches(loader, 5, per_epoch=2)]
    perms = [torch.randperm(8, generator=torch.Generator().manual_seed(e)).tolist() for e in range(3)]
    assert got == [perms[0][:2], perms[0][2:4], perms[1][:2], perms[1][2:4], perms[2][:2]]
