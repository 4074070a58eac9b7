"""Both callbacks in a real (tiny, CPU) Lightning run, checked against independent bookkeeping."""

from __future__ import annotations

import math
from collections import defaultdict

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from moe_lab.callbacks import ExpertLoadCallback, GradNormCallback

from .conftest import TinyModule, loader, metric_by_step, random_batches, read_csv_metrics, ref_load_stats

ACCUMULATE = 2
MAX_STEPS = 6


class RoutingRecorder(L.Callback):
    """Counts expert assignments per batch from forward hooks on the routers (pad tokens excluded).

    It also zeroes every layer's ``counts`` after each batch, as other code may, which must not disturb
    ExpertLoadCallback (it reads the monotonic ``total_counts``)."""

    def __init__(self):
        self.per_batch: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
        self.mask = None
        self.batch_idx = None
        self.counts_matched = []

    def on_train_start(self, trainer, pl_module):
        for view, layer in zip(pl_module.patch.views, pl_module.patch.layers):
            view.router.register_forward_hook(self._hook(layer.index, layer.num_experts))

    def _hook(self, index, num_experts):
        def hook(module, args, output):
            indices = output[2]  # (logits, weights, indices)
            real = indices[self.mask.reshape(-1).bool()]
            counts = torch.bincount(real.reshape(-1), minlength=num_experts)
            prev = self.per_batch[self.batch_idx].get(index, torch.zeros(num_experts, dtype=torch.long))
            self.per_batch[self.batch_idx][index] = prev + counts

        return hook

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mask, self.batch_idx = batch["attention_mask"], batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for layer in pl_module.patch.layers:
            self.counts_matched.append(torch.equal(layer.counts, self.per_batch[batch_idx][layer.index]))
        pl_module.patch.reset_counts()


class GradRecorder(L.Callback):
    """Per-group gradient norms from parameter *names* (not moe_lab's grouping), per optimizer step."""

    def __init__(self):
        self.norms: dict[int, dict[str, float]] = {}

    @staticmethod
    def group_of(name: str) -> str:
        if name.endswith("mlp.gate.weight"):
            return "router"
        if ".mlp.experts." in name:
            return "experts"
        if ".self_attn." in name:
            return "attention"
        if "embed_tokens" in name or name.startswith("lm_head"):
            return "embeddings"
        return "other"

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        sq = defaultdict(float)
        for name, p in pl_module.model.named_parameters():
            if p.grad is not None:
                sq[self.group_of(name)] += float((p.grad.double() ** 2).sum())
        out = {k: math.sqrt(v) for k, v in sq.items()}
        out["total"] = math.sqrt(sum(sq.values()))
        self.norms[trainer.global_step + 1] = out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    load_cb = ExpertLoadCallback(log_every_n_steps=2, heatmap_every_n_steps=3)
    grad_cb = GradNormCallback(log_every_n_steps=2)
    routing, grads = RoutingRecorder(), GradRecorder()
    module = TinyModule()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=MAX_STEPS,
        accumulate_grad_batches=ACCUMULATE,
        logger=CSVLogger(tmp),
        log_every_n_steps=1,  # Lightning flushes every step: the callbacks must not re-log stale values
        default_root_dir=tmp,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[load_cb, grad_cb, routing, grads],  # the recorders run after the callbacks under test
    )
    trainer.fit(module, loader(random_batches(MAX_STEPS * ACCUMULATE)))
    rows = read_csv_metrics(tmp / "lightning_logs" / "version_0" / "metrics.csv")
    return {
        "tmp": tmp,
        "trainer": trainer,
        "load": load_cb,
        "grad": grad_cb,
        "routing": routing,
        "grads": grads,
        "rows": rows,
        "module": module,
    }


def test_columns_exist_and_are_finite(run):
    rows = run["rows"]
    for key in (
        "load/layer0/gini",
        "load/layer1/imbalance",
        "load/gini_mean",
        "grad_norm/total",
        "grad_norm/router",
        "grad_norm/experts",
        "train/loss",
    ):
        values = metric_by_step(rows, key)
        assert values, key
        assert all(math.isfinite(v) for v in values.values()), key
    # No shared experts in OLMoE: an empty group is not logged.
    assert not metric_by_step(rows, "grad_norm/shared_experts")


def test_logged_once_per_window_on_lightning_step_axis(run):
    rows = run["rows"]
    # optimizer steps 2, 4, 6 -> Lightning's logging step is global_step - 1, like train/loss
    assert sorted(metric_by_step(rows, "load/layer0/gini")) == [1, 3, 5]
    assert sorted(metric_by_step(rows, "grad_norm/total")) == [1, 3, 5]
    assert sorted(metric_by_step(rows, "train/loss")) == list(range(MAX_STEPS))


def test_heatmaps_written(run):
    plots = run["tmp"] / "plots"
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["expert_load_latest.png", "expert_load_step000003.png", "expert_load_step000006.png"]
    # training ended on a heatmap step: the final window is empty, latest is the step-6 map
    assert (plots / "expert_load_latest.png").read_bytes() == (
        plots / "expert_load_step000006.png"
    ).read_bytes()
    assert run["load"].latest_heatmap == plots / "expert_load_step000006.png"


def test_load_stats_match_independent_router_counts(run):
    routing, rows = run["routing"], run["rows"]
    assert routing.counts_matched and all(routing.counts_matched)  # the hook counts like the patch
    assert len(routing.per_batch) == MAX_STEPS * ACCUMULATE
    layers = [layer.index for layer in run["module"].patch.layers]
    for step in (2, 4, 6):  # window = optimizer steps step-1, step = batches (step-2)*A .. step*A-1
        batches = range((step - 2) * ACCUMULATE, step * ACCUMULATE)
        for index in layers:
            counts = sum(routing.per_batch[b][index] for b in batches)
            ref = ref_load_stats(counts.tolist())
            for name in ("imbalance", "gini", "entropy", "entropy_norm"):
                logged = metric_by_step(rows, f"load/layer{index}/{name}")[step - 1]
                assert logged == pytest.approx(ref[name], rel=1e-9, abs=1e-12), (step, index, name)
        if step == MAX_STEPS:
            latest = run["load"].latest["counts"]
            expected = torch.stack([sum(routing.per_batch[b][i] for b in batches) for i in layers])
            assert torch.equal(latest, expected)
    for step in (2, 4, 6):
        ginis = [metric_by_step(rows, f"load/layer{i}/gini")[step - 1] for i in layers]
        assert metric_by_step(rows, "load/gini_mean")[step - 1] == pytest.approx(sum(ginis) / len(ginis))


def test_pad_tokens_are_not_counted(run):
    routing, module = run["routing"], run["module"]
    batches = random_batches(MAX_STEPS * ACCUMULATE)
    top_k = module.patch.layers[0].top_k
    for b, batch in enumerate(batches):
        real = int(batch["attention_mask"].sum())
        assert real < batch["attention_mask"].numel()
        for counts in routing.per_batch[b].values():
            assert int(counts.sum()) == real * top_k


def test_grad_norms_match_independent_norms(run):
    rows, recorded = run["rows"], run["grads"].norms
    assert sorted(recorded) == list(range(1, MAX_STEPS + 1))
    for step in (2, 4, 6):
        for group in ("total", "router", "experts", "attention", "embeddings", "other"):
            logged = metric_by_step(rows, f"grad_norm/{group}")[step - 1]
            assert logged == pytest.approx(recorded[step][group], rel=1e-4), (step, group)
        groups = [
            metric_by_step(rows, f"grad_norm/{g}")[step - 1]
            for g in ("router", "experts", "attention", "embeddings", "other")
        ]
        total = metric_by_step(rows, "grad_norm/total")[step - 1]
        assert math.sqrt(sum(g * g for g in groups)) == pytest.approx(total, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (fp16 GradScaler)")
def test_fp16_amp_grad_norms_are_unscaled():
    """With 16-mixed on CUDA, Lightning unscales before on_before_optimizer_step: norms match fp32."""
    norms = {}
    for precision in ("32-true", "16-mixed"):
        cb = GradNormCallback()
        trainer = L.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=1,
            precision=precision,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[cb],
        )
        trainer.fit(TinyModule(), loader(random_batches(1)))
        norms[precision] = cb.latest["grad_norm/total"]
        if precision == "16-mixed":
            assert trainer.precision_plugin.scaler.get_scale() > 1  # scaled grads would be far larger
    assert norms["16-mixed"] == pytest.approx(norms["32-true"], rel=0.05)
