"""Typed settings (moe_lab.core.settings): defaults, ranges and unknown keys named by their field; the run length
counted as Lightning's fit loop counts it (a step-by-step simulation of the loop as the oracle)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from moe_lab.core.settings import Optim, RunLength, Schedule, read


def test_defaults_and_every_field_documented():
    assert read(Optim, None, "task.optim") == Optim(lr=1e-4, weight_decay=0.0, betas=[0.9, 0.999], eps=1e-8)
    assert read(Schedule, {}, "task.scheduler") == Schedule("constant", 0, None, 0.0)
    for cls in (Optim, Schedule):
        assert all(f.metadata["doc"] for f in dataclasses.fields(cls))


@pytest.mark.parametrize(("cls", "prefix", "values", "message"), [
    (Optim, "task.optim", {"lr": -1e-3}, "task.optim.lr=-0.001 must be >= 0.0"),
    (Optim, "task.optim", {"lr": "3e-4"}, "task.optim.lr='3e-4' is not a number: write it out in digits"),
    (Optim, "task.optim", {"weight_decay": -0.1}, "task.optim.weight_decay=-0.1 must be >= 0.0"),
    (Optim, "task.optim", {"eps": float("inf")}, "task.optim.eps=inf must be finite"),
    (Optim, "task.optim", {"beta": [0.9, 0.95]}, "task.optim.beta is not a setting of task.optim: choose from"),
    (Schedule, "task.scheduler", {"name": "cos"}, "task.scheduler.name='cos' is unknown: choose one of"),
    (Schedule, "task.scheduler", {"warmup_steps": 1.5}, "task.scheduler.warmup_steps=1.5 must be a whole number"),
    (Schedule, "task.scheduler", {"warmup_ratio": 1.5}, "task.scheduler.warmup_ratio=1.5 must be in [0, 1]"),
    (Schedule, "task.scheduler", {"min_lr_ratio": -1}, "task.scheduler.min_lr_ratio=-1 must be in [0, 1]"),
])
def test_a_bad_value_is_refused_naming_its_field(cls, prefix, values, message):
    with pytest.raises(ValueError) as err:
        read(cls, values, prefix)
    assert str(err.value).startswith(message)


def _simulate(micro: int, max_steps: int, max_epochs: int, accumulate: int) -> tuple[int, int]:
    """(optimizer steps, micro-batches read) of Lightning's fit loop, batch by batch: a step every ``accumulate``
    micro-batches and at an epoch's last one; the fit ends at ``max_steps`` steps or after ``max_epochs`` epochs."""
    steps = read_ = 0
    for epoch in itertools.count():
        if max_epochs > 0 and epoch == max_epochs:
            break
        for i in range(micro):
            read_ += 1
            if (i + 1) % accumulate == 0 or i + 1 == micro:
                steps += 1
                if 0 < max_steps == steps:
                    return steps, read_
    return steps, read_


@pytest.mark.parametrize("micro", [1, 5, 8])
@pytest.mark.parametrize("accumulate", [1, 2, 3])
@pytest.mark.parametrize(("max_steps", "max_epochs"), [(4, -1), (-1, 2), (7, 2), (100, 3), (1, 1)])
def test_run_length_counts_as_the_fit_loop_does(micro, accumulate, max_steps, max_epochs):
    length = RunLength.of({"max_steps": max_steps, "max_epochs": max_epochs, "accumulate_grad_batches": accumulate})
    steps, read_ = _simulate(micro, max_steps, max_epochs, accumulate)
    assert length.optimizer_steps(micro) == steps
    assert length.micro_batches(micro) >= read_  # an upper bound: an epoch's last step may take fewer
    if max_steps < 0:
        assert length.micro_batches(micro) == read_


@pytest.mark.parametrize(("trainer", "message"), [
    ({"max_steps": 0}, "task.trainer.max_steps=0 must be >= 1"),
    ({"max_steps": -1, "max_epochs": -1}, "the run would never end"),
    ({"max_steps": 10, "max_epochs": 0}, "task.trainer.max_epochs=0 must be >= 1"),
    ({"max_steps": "1k"}, "task.trainer.max_steps='1k' is not a number"),
])
def test_a_run_that_would_not_end_or_not_start_is_refused(trainer, message):
    with pytest.raises(ValueError, match=message):
        RunLength.of(trainer)
    assert RunLength.of({"max_steps": 5}).optimizer_steps(None) == 5
    assert RunLength.of({"max_steps": -1, "max_epochs": 2}).optimizer_steps(None) is None


def test_given_reads_a_trainer_unchecked():
    assert RunLength.given({"max_steps": None, "max_epochs": 3}) == RunLength(-1, 3, 1)
    assert RunLength.given({"max_steps": 0}).step_limit is None and RunLength.given(None) == RunLength()


def test_loop_defaults_are_lightnings_and_its_fields_are_trainer_arguments():
    """Loop's defaults are the Trainer's own (so a field left out means what Lightning does), field by field."""
    import inspect

    from lightning.pytorch import Trainer

    from moe_lab.core.settings import Loop

    trainer = inspect.signature(Trainer.__init__).parameters
    for f in dataclasses.fields(Loop):
        assert f.name in trainer, f.name
        assert f.default == trainer[f.name].default, (f.name, f.default, trainer[f.name].default)
        assert f.metadata["doc"], f.name


@pytest.mark.parametrize("trainer,message", [
    ({"max_steps": 10, "accumulate_grad_batches": 0}, "task.trainer.accumulate_grad_batches=0 must be >= 1"),
    ({"max_steps": 10, "log_every_n_steps": "5x"}, "task.trainer.log_every_n_steps='5x' is not a number"),
    ({"max_steps": 10, "gradient_clip_algorithm": "l2"}, "task.trainer.gradient_clip_algorithm='l2' is unknown"),
    ({"max_steps": 10, "limit_val_batches": -1}, "task.trainer.limit_val_batches=-1 must be >= 0"),
    ({"max_steps": 10, "val_check_interval": 2.5}, "task.trainer.val_check_interval=2.5: use a number of training"),
    ({"max_steps": 10, "num_node": 2}, ("task.trainer.num_node is not an argument of Lightning's Trainer; did "
                                        "you mean task.trainer.num_nodes")),
])
def test_read_loop_refuses_by_field(trainer, message):
    from moe_lab.core.settings import read_loop

    with pytest.raises(ValueError) as refused:
        read_loop(trainer)
    assert message in str(refused.value)


def test_read_loop_passes_any_trainer_argument_through():
    from moe_lab.core.settings import read_loop

    given = {"max_steps": 10, "val_check_interval": 0.5, "num_nodes": 2, "deterministic": True,
             "check_val_every_n_epoch": None}
    assert read_loop(given) == given
