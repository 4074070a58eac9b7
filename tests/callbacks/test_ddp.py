"""ExpertLoadCallback under real 2-process DDP (gloo, CPU): logged stats are those of the summed counts."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from moe_lab.callbacks import ExpertLoadCallback, GradNormCallback

from .conftest import TinyModule, metric_by_step, random_batches, read_csv_metrics, ref_load_stats, tiny_model

pytestmark = pytest.mark.slow

STEPS = 4


class LazyTinyModule(TinyModule):
    """Builds the patched model in each process: moe-lab's dynamic router classes do not pickle."""

    def __init__(self):
        L.LightningModule.__init__(self)
        self.lr = 1e-3
        self.model = self.patch = None

    def configure_model(self):
        if self.model is None:
            self.model, self.patch = tiny_model()


class DumpTotals(L.Callback):
    """Each rank writes its layers' total_counts after every optimizer step."""

    def __init__(self, out_dir):
        self.out_dir = str(out_dir)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        totals = {layer.index: layer.total_counts.tolist() for layer in pl_module.patch.layers}
        path = f"{self.out_dir}/rank{trainer.global_rank}_step{trainer.global_step}.json"
        with open(path, "w") as f:
            json.dump(totals, f)


def test_ddp_counts_are_summed_over_ranks(tmp_path):
    rows = [{k: v[i] for k, v in b.items()} for b in random_batches(STEPS * 2, batch=2) for i in range(2)]
    data = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=STEPS,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ExpertLoadCallback(log_every_n_steps=2, heatmap_every_n_steps=2),
            GradNormCallback(),
            DumpTotals(tmp_path),
        ],
    )
    trainer.fit(LazyTinyModule(), data)

    logged = read_csv_metrics(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")

    def totals(rank, step):
        with open(tmp_path / f"rank{rank}_step{step}.json") as f:
            return {int(k): torch.tensor(v) for k, v in json.load(f).items()}

    for step in (2, 4):
        before = [totals(r, step - 2) if step > 2 else None for r in (0, 1)]
        after = [totals(r, step) for r in (0, 1)]
        assert not torch.equal(after[0][0], after[1][0])  # the ranks saw different tokens
        for index in after[0]:
            window = sum(after[r][index] - (before[r][index] if before[r] else 0) for r in (0, 1))
            ref = ref_load_stats(window.tolist())
            for name in ("imbalance", "gini", "entropy"):
                value = metric_by_step(logged, f"load/layer{index}/{name}")[step - 1]
                assert value == pytest.approx(ref[name], rel=1e-9), (step, index, name)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "expert_load_latest.png",
        "expert_load_step000002.png",
        "expert_load_step000004.png",
    ]
