"""The callbacks' bookkeeping without a Trainer: windows, all-reduce, accumulation; grouped grad norms."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moe_lab.callbacks import ExpertLoadCallback, GradNormCallback

from .conftest import random_batches, ref_load_stats, tiny_model


class FakeStrategy:
    """Stands in for DDP with `world` identical ranks: a sum all-reduce multiplies by `world`."""

    def __init__(self, world: int):
        self.world, self.calls = world, []

    def reduce(self, tensor, reduce_op="mean"):
        self.calls.append((reduce_op, tensor.dtype))
        assert reduce_op == "sum"
        return tensor * self.world


class FakeModule:
    def __init__(self, layers):
        self.patch = SimpleNamespace(layers=layers)
        self.logged = []

    def log_dict(self, metrics, **kwargs):
        assert kwargs["on_step"] and not kwargs["on_epoch"] and not kwargs["sync_dist"]
        self.logged.append(dict(metrics))


def _layer(index, num_experts):
    return SimpleNamespace(
        index=index, num_experts=num_experts, top_k=2, total_counts=torch.zeros(num_experts, dtype=torch.long)
    )  # top_k: MoEBlock's, read by the heatmaps' shared colour scale


def _trainer(tmp_path, strategy, rank_zero=True):
    return SimpleNamespace(
        global_step=0,
        strategy=strategy,
        is_global_zero=rank_zero,
        loggers=[],
        default_root_dir=str(tmp_path),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=0)),
    )


def test_windows_reduce_and_accumulation(tmp_path):
    layers = [_layer(3, 4), _layer(5, 4)]
    module, strategy = FakeModule(layers), FakeStrategy(world=2)
    trainer = _trainer(tmp_path, strategy)
    layers[0].total_counts += torch.tensor([100, 0, 0, 0])  # routed before training: not in any window
    cb = ExpertLoadCallback(log_every_n_steps=2, heatmap_every_n_steps=4, plot_dir=tmp_path / "p")
    cb.on_train_start(trainer, module)

    adds = {  # (global_step after the micro-batch, per-layer counts of that micro-batch)
        0: ([1, 0, 0, 0], [0, 1, 0, 0]),  # micro-batch 1 of step 1 (accumulating)
        1: ([0, 1, 0, 0], [0, 1, 0, 0]),
        2: ([0, 0, 3, 0], [1, 1, 1, 1]),  # step 2 ends here
    }
    micro = [(0, adds[0]), (1, adds[1]), (1, None), (2, adds[2]), (2, None)]  # repeated steps: accumulation
    for step, add in micro:
        if add is not None:
            for layer, counts in zip(layers, add):
                layer.total_counts += torch.tensor(counts)
        trainer.global_step = step
        trainer.fit_loop.epoch_loop._batches_that_stepped = max(step - 1, 0)
        cb.on_train_batch_end(trainer, module, None, None, 0)
    assert len(module.logged) == 1  # only once at step 2 though on_train_batch_end saw step 2 twice
    expected = torch.tensor([[1, 1, 3, 0], [1, 3, 1, 1]]) * 2  # summed over the 2 "ranks"
    assert torch.equal(cb.latest["counts"], expected)
    assert cb.latest["step"] == 2
    assert strategy.calls and all(c == ("sum", torch.int64) for c in strategy.calls)
    for row, index in enumerate((3, 5)):
        ref = ref_load_stats(expected[row].tolist())
        for name, value in ref.items():
            assert module.logged[0][f"load/layer{index}/{name}"] == pytest.approx(value)
    assert module.logged[0]["load/imbalance_mean"] == pytest.approx(
        (ref_load_stats([1, 1, 3, 0])["imbalance"] + ref_load_stats([1, 3, 1, 1])["imbalance"]) / 2
    )

    # Step 4: next window only; a layer with no tokens gives nan stats and is left out of the means.
    layers[0].total_counts += torch.tensor([0, 0, 0, 5])
    trainer.global_step = 4
    cb.on_train_batch_end(trainer, module, None, None, 0)
    assert torch.equal(cb.latest["counts"], torch.tensor([[0, 0, 0, 10], [0, 0, 0, 0]]))
    assert math.isnan(cb.latest["load/layer5/gini"])
    assert cb.latest["load/gini_mean"] == pytest.approx(0.75)
    assert (tmp_path / "p" / "expert_load_step000004.png").exists()
    assert cb.latest_heatmap.name == "expert_load_step000004.png"

    # Train end right after a heatmap step: nothing new, no new file; after new tokens: a final map.
    cb.on_train_end(trainer, module)
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "expert_load_latest.png",
        "expert_load_step000004.png",
    ]
    layers[1].total_counts += 1
    trainer.global_step = 5
    cb.on_train_batch_end(trainer, module, None, None, 0)
    cb.on_train_end(trainer, module)
    assert (tmp_path / "p" / "expert_load_step000005.png").exists()
    assert cb.latest_heatmap.name == "expert_load_step000005.png"


def test_non_zero_rank_reduces_but_writes_nothing(tmp_path):
    layers = [_layer(0, 2)]
    module, strategy = FakeModule(layers), FakeStrategy(world=3)
    trainer = _trainer(tmp_path, strategy, rank_zero=False)
    cb = ExpertLoadCallback(log_every_n_steps=1, heatmap_every_n_steps=1)
    cb.on_train_start(trainer, module)
    layers[0].total_counts += torch.tensor([2, 1])
    trainer.global_step = 1
    cb.on_train_batch_end(trainer, module, None, None, 0)
    assert len(strategy.calls) == 2  # the collective happens on every rank (stats and heatmap)
    assert torch.equal(cb.latest["counts"], torch.tensor([[6, 3]]))
    assert not (tmp_path / "plots").exists()


class Holder(nn.Module):
    def __init__(self, model, patch, extra=True):
        super().__init__()
        self.model, self.patch = model, patch
        self.extra = nn.Linear(3, 1) if extra else None


def _backward(holder, extra_input=True):
    batch = random_batches(1, seq=8)[0]
    loss = holder.model(**batch).loss
    if extra_input:
        loss = loss + holder.extra(torch.ones(3)).sum()
    loss.backward()


def _manual_norm(params, p=2.0):
    grads = [q.grad.double().flatten() for q in params if q.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat(grads), p))


def test_grad_norms_shared_experts_extra_params_and_frozen(tmp_path):
    model, patch = tiny_model("tiny_qwen2_moe")
    holder = Holder(model, patch)
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_output_embeddings().weight.requires_grad_(False)
    _backward(holder)
    norms = GradNormCallback().grad_norms(holder)
    groups = patch.parameter_groups()
    assert "grad_norm/embeddings" not in norms  # frozen: no grad, group not logged
    assert norms["grad_norm/shared_experts"] > 0
    for name in ("router", "experts", "shared_experts", "attention"):
        expected = _manual_norm([p for _, p in groups[name]])
        assert norms[f"grad_norm/{name}"] == pytest.approx(expected, rel=1e-5), name
    # parameters of the module outside the model count as "other"
    other = [p for _, p in groups["other"]] + list(holder.extra.parameters())
    assert norms["grad_norm/other"] == pytest.approx(_manual_norm(other), rel=1e-5)
    assert norms["grad_norm/total"] == pytest.approx(_manual_norm(list(holder.parameters())), rel=1e-5)

    inf = GradNormCallback(norm_type="inf").grad_norms(holder)
    assert inf["grad_norm/total"] == pytest.approx(_manual_norm(list(holder.parameters()), math.inf))
    assert inf["grad_norm/total"] == pytest.approx(max(v for k, v in inf.items() if k != "grad_norm/total"))


def test_grad_norm_without_grads_or_patch():
    model, patch = tiny_model("tiny_olmoe")
    holder = Holder(model, patch, extra=False)
    assert GradNormCallback().grad_norms(holder) == {}
    plain = nn.Linear(4, 2)
    plain(torch.ones(4)).sum().backward()
    only_total = GradNormCallback().grad_norms(plain)
    assert list(only_total) == ["grad_norm/total"]
    assert only_total["grad_norm/total"] == pytest.approx(_manual_norm(list(plain.parameters())))


def test_load_window_continues_across_a_resume(tmp_path):
    """Log every 4 steps, checkpoint at step 2 of 2 "ranks": the resumed process starts its total_counts at zero,
    yet its first log (step 4) is of steps 1-4, as the uninterrupted callback's: the hand sum of every step's
    counts, times 2 ranks."""
    steps = {1: [1, 0, 0, 0], 2: [0, 2, 0, 0], 3: [0, 0, 3, 0], 4: [5, 0, 0, 1]}

    def run(callback, layer, trainer, module, todo):
        for step in todo:
            layer.total_counts += torch.tensor(steps[step])
            trainer.global_step = step
            callback.on_train_batch_end(trainer, module, None, None, 0)

    straight_layer, straight = _layer(0, 4), ExpertLoadCallback(log_every_n_steps=4, heatmap_every_n_steps=0)
    module, trainer = FakeModule([straight_layer]), _trainer(tmp_path, FakeStrategy(world=2))
    straight.on_train_start(trainer, module)
    run(straight, straight_layer, trainer, module, [1, 2])
    checkpoint = {"callbacks": {}}
    straight.on_save_checkpoint(trainer, module, checkpoint)  # written at step 2, before the kill
    run(straight, straight_layer, trainer, module, [3, 4])

    layer, resumed = _layer(0, 4), ExpertLoadCallback(log_every_n_steps=4, heatmap_every_n_steps=0)
    module2, trainer2 = FakeModule([layer]), _trainer(tmp_path, FakeStrategy(world=2))
    trainer2.global_step = 2
    resumed.load_state_dict(checkpoint["callbacks"][resumed.state_key])
    resumed.on_train_start(trainer2, module2)
    run(resumed, layer, trainer2, module2, [3, 4])
    expected = torch.tensor([[6, 2, 3, 1]]) * 2
    assert torch.equal(straight.latest["counts"], expected) and torch.equal(resumed.latest["counts"], expected)
    assert module2.logged == module.logged[-1:]
