"""Typed settings: the optimizer (``task.optim``), the learning-rate schedule (``task.scheduler``), the training
loop (``task.trainer``: :class:`Loop`) and the run's length (``task.trainer.max_steps`` / ``max_epochs`` /
``accumulate_grad_batches``). Each field's default, type,
range and doc line is written once, in its dataclass; :func:`read` turns a config node into the dataclass and
refuses a value of the wrong type, out of its range or under an unknown key, naming the field and the fix. The
methods train from these objects; the preflight, the plan, the resume and the teacher-logits record read the run's
length from :class:`RunLength`, the one place that counts a run's optimizer steps and micro-batches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from .plain import to_plain

SCHEDULES = ("cosine", "linear", "constant")


def meta(doc: str, *, low: float | None = None, strict: bool = False, high: float | None = None,
         choices: tuple | None = None, kind: str | None = None) -> dict:
    """A settings field's metadata: its doc line and its range, ``>= low`` (``> low`` when ``strict``), ``<= high``,
    one of ``choices``; ``kind``: ``int`` / ``float`` for a number (None: any value)."""
    return {"doc": doc, "low": low, "strict": strict, "high": high, "choices": choices, "kind": kind}


def setting(default, doc: str, **limits):
    """A dataclass field with its default, doc line and range (:func:`meta`)."""
    return field(default=default, metadata=meta(doc, **limits))


def number(name: str, value, kind: str):
    """``value`` of config field ``name`` as a finite number of ``kind`` (``int`` / ``float``), else a ValueError
    saying how to write it."""
    example = {"int": "1000", "float": "3e-4"}[kind]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(  # noqa: TRY004 - a config value, reported like every other bad value
            f"{name}={value!r} is not a number: write it out in digits, e.g. {name}={example}")
    if kind == "int" and (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{name}={value!r} must be a whole number, e.g. {name}={example}")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be finite, e.g. {name}={example}")
    return value


def _checked(name: str, value, limits: Mapping):
    if value is None:
        return value
    if limits["choices"] is not None and value not in limits["choices"]:
        raise ValueError(f"{name}={value!r} is unknown: choose one of {limits['choices']}")
    if limits["kind"] is not None:
        value = number(name, value, limits["kind"])
        low, high, strict = limits["low"], limits["high"], limits["strict"]
        if high is not None and low is not None and not (low <= value <= high):
            raise ValueError(f"{name}={value} must be in [{low}, {high}]")
        if low is not None and (value < low or (strict and value == low)):
            raise ValueError(f"{name}={value} must be {'>' if strict else '>='} {low}")
    return value


def read(cls, node, prefix: str):
    """``cls`` (a settings dataclass) from config node ``node`` (a mapping, a DictConfig or None: the defaults);
    every value checked against its field, named ``<prefix>.<field>``."""
    values = to_plain(node) or {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{prefix}.{unknown[0]} is not a setting of {prefix}: choose from {sorted(fields)}")
    return cls(**{name: _checked(f"{prefix}.{name}", values[name], f.metadata)
                  for name, f in fields.items() if name in values})


@dataclass
class Optim:
    """``task.optim``: AdamW's settings (a module built outside run.py trains with these defaults)."""

    lr: float = setting(1e-4, "the peak learning rate (0: the weights stay as loaded, e.g. a bias-only phase; "
                        "task=finetune refuses it)", low=0.0, kind="float")
    weight_decay: float = setting(0.0, "decoupled weight decay (not on biases and norms)", low=0.0, kind="float")
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata=meta("Adam's (beta1, beta2)"))
    eps: float = setting(1e-8, "Adam's epsilon", low=0.0, strict=True, kind="float")


@dataclass
class Schedule:
    """``task.scheduler``: linear warm-up from 0, then a cosine, linear or constant schedule (HF/TRL's)."""

    name: str = setting("constant", "cosine | linear | constant", choices=SCHEDULES)
    warmup_steps: int = setting(0, "warm-up optimizer steps", low=0, kind="int")
    warmup_ratio: float | None = setting(None, "warm-up as a fraction of the run's optimizer steps (HF: ceil); "
                                         "overrides warmup_steps", low=0, high=1, kind="float")
    min_lr_ratio: float = setting(0.0, "the rate at the last step, as a fraction of lr", low=0, high=1, kind="float")


@dataclass
class Loop:
    """``task.trainer``: the Lightning ``Trainer`` loop settings moe-lab reads, typed. The defaults are Lightning's
    (each task's config sets its own values: conf/task/finetune.yaml); any other ``Trainer`` argument in
    ``task.trainer`` (``+task.trainer.num_nodes=2``) is passed to Lightning as it is, and one the ``Trainer``
    does not take is refused by name (:func:`read_loop`). The run's length is :class:`RunLength`'s."""

    max_steps: int = setting(-1, "optimizer steps (-1: no limit, the epochs end the run)", low=-1, kind="int")
    max_epochs: int | None = setting(None, "epochs (-1: no limit; null: Lightning's 1000 when max_steps is -1)",
                                     low=-1, kind="int")
    accumulate_grad_batches: int = setting(1, "micro-batches per optimizer step", low=1, kind="int")
    log_every_n_steps: int | None = setting(None, "training batches between logged rows (null: 50)", low=1,
                                            kind="int")
    val_check_interval: float | None = setting(None, "validate every N training batches (a whole number) or a "
                                               "fraction of an epoch in (0, 1]", kind="float")
    check_val_every_n_epoch: int | None = setting(1, "validate every N epochs (null: by val_check_interval alone)",
                                                  low=1, kind="int")
    limit_val_batches: float | None = setting(None, "validation batches per validation (a whole number) or a "
                                              "fraction of the set (null: all)", low=0, kind="float")
    limit_train_batches: float | None = setting(None, "training batches per epoch (a whole number) or a fraction "
                                                "(null: all)", low=0, kind="float")
    gradient_clip_val: float | None = setting(None, "clip gradients to this norm (or value); null or 0: no "
                                              "clipping", low=0, kind="float")
    gradient_clip_algorithm: str | None = setting(None, "norm | value (null: norm)", choices=("norm", "value"))
    num_sanity_val_steps: int | None = setting(None, "validation batches before training (-1: all; null: 2)",
                                               low=-1, kind="int")
    enable_progress_bar: bool | None = setting(None, "Lightning's progress bar (moe-lab sets it: on with "
                                               "callbacks=progress_bar)")
    enable_model_summary: bool | None = setting(None, "Lightning's model summary table (null: on)")


def read_loop(node, prefix: str = "task.trainer") -> dict:
    """``task.trainer`` checked: each :class:`Loop` field against its type and range; any other key must be an
    argument of Lightning's ``Trainer`` (a ValueError naming it and the close ones otherwise). Returns the values
    as given."""
    values = to_plain(node) or {}
    fields = {f.name: f for f in dataclasses.fields(Loop)}
    for name, value in values.items():
        if name in fields:
            _checked(f"{prefix}.{name}", value, fields[name].metadata)
    interval = values.get("val_check_interval")
    if interval is not None and (interval <= 0 or (isinstance(interval, float) and not interval.is_integer()
                                                   and interval > 1)):
        raise ValueError(f"{prefix}.val_check_interval={interval}: use a number of training batches (e.g. "
                         "250) or a fraction of an epoch in (0, 1]")
    others = sorted(set(values) - set(fields))
    if others:
        import difflib
        import inspect

        from lightning.pytorch import Trainer

        accepted = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
        for name in others:
            if name not in accepted:
                close = difflib.get_close_matches(name, sorted(accepted | set(fields)), n=3)
                hint = f"; did you mean {' or '.join(f'{prefix}.{c}' for c in close)}?" if close else ""
                raise ValueError(f"{prefix}.{name} is not an argument of Lightning's Trainer{hint}")
    return values


STEPS, EPOCHS = "task.trainer.max_steps", "task.trainer.max_epochs"


@dataclass(frozen=True)
class RunLength:
    """How long a Lightning fit runs: ``max_steps`` optimizer steps (-1: no limit), ``max_epochs`` epochs (-1: no
    limit), an optimizer step every ``accumulate_grad_batches`` micro-batches and at the end of each epoch."""

    max_steps: int = -1
    max_epochs: int = -1
    accumulate_grad_batches: int = 1

    @classmethod
    def of(cls, trainer) -> RunLength:
        """The length of a ``task.trainer`` node, checked: it ends (``max_steps >= 1``, or ``-1`` with ``max_epochs
        >= 1``), naming the field and the fix otherwise."""
        t = to_plain(trainer) or {}
        steps = -1 if t.get("max_steps") is None else number(STEPS, t["max_steps"], "int")
        epochs = -1 if t.get("max_epochs") is None else number(EPOCHS, t["max_epochs"], "int")
        if epochs == 0 or epochs < -1:
            raise ValueError(f"{EPOCHS}={epochs} must be >= 1, or -1 to end the run by {STEPS}")
        if steps == 0:
            raise ValueError(f"{STEPS}=0 must be >= 1, or -1 with {EPOCHS} >= 1 (max_steps=0 trains "
                             "nothing: to score a model without training use task=evaluate)")
        if steps < -1:
            raise ValueError(f"{STEPS}={steps} must be >= 1, or -1 with {EPOCHS} >= 1")
        if steps == -1 and epochs == -1:
            raise ValueError(f"{STEPS}=-1 and {EPOCHS}=-1: the run would never end. Set {STEPS} "
                             f"(e.g. {STEPS}=1000) or {EPOCHS} (e.g. {EPOCHS}=2 {STEPS}=-1)")
        return cls(int(steps), int(epochs), int(t.get("accumulate_grad_batches") or 1))

    @classmethod
    def given(cls, trainer) -> RunLength:
        """The length a ``task.trainer`` node (or a Lightning trainer's settings) asks for, unchecked (a missing or
        null limit: none); :meth:`of` checks it as the preflight does."""
        t = to_plain(trainer) or {}
        return cls(int(t.get("max_steps") if t.get("max_steps") is not None else -1),
                   int(t.get("max_epochs") if t.get("max_epochs") is not None else -1),
                   int(t.get("accumulate_grad_batches") or 1))

    @property
    def step_limit(self) -> int | None:
        """``max_steps`` as a limit (None: none; :meth:`of` refuses 0)."""
        return None if self.max_steps < 1 else self.max_steps

    @property
    def epoch_limit(self) -> int | None:
        """``max_epochs`` as a limit (None: none; :meth:`of` refuses 0)."""
        return None if self.max_epochs < 1 else self.max_epochs

    def steps_per_epoch(self, micro_batches_per_epoch: int) -> int:
        """Optimizer steps of one epoch of ``micro_batches_per_epoch`` micro-batches."""
        return math.ceil(micro_batches_per_epoch / self.accumulate_grad_batches)

    def optimizer_steps(self, micro_batches_per_epoch: int | None) -> int | None:
        """The run's optimizer steps: the first limit reached (None: epochs of unknown length, no step limit)."""
        by_epochs = None
        if self.epoch_limit is not None and micro_batches_per_epoch is not None:
            by_epochs = self.steps_per_epoch(micro_batches_per_epoch) * self.epoch_limit
        if self.step_limit is None:
            return by_epochs
        return self.step_limit if by_epochs is None else min(by_epochs, self.step_limit)

    def micro_batches(self, micro_batches_per_epoch: int | None) -> int:
        """Micro-batches the run reads at most: ``max_steps x accumulate_grad_batches`` when steps limit it (an
        epoch's last step may take fewer), else ``max_epochs`` epochs (their length must be known)."""
        if self.step_limit is not None:
            return self.step_limit * self.accumulate_grad_batches
        if self.epoch_limit is None or micro_batches_per_epoch is None:
            raise ValueError(f"the run's length is unknown: set {STEPS} (or {EPOCHS} with a dataset of known "
                             "length)")
        return self.epoch_limit * micro_batches_per_epoch


#: Hydra's ConfigStore group of the settings schemas: conf/task/finetune.yaml builds ``task.optim`` and
#: ``task.scheduler`` on them, so a composed config holds every field, typed (a value of the wrong type or an unknown
#: key is refused when the config is composed); :func:`read` checks the ranges
SCHEMA_GROUP = "moe_lab_schema"


def register_schemas() -> None:
    """Store :class:`Optim` and :class:`Schedule` in Hydra's ConfigStore (``moe_lab_schema/optim``,
    ``moe_lab_schema/scheduler``); ``import moe_lab`` calls it."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group=SCHEMA_GROUP, name="optim", node=Optim)
    store.store(group=SCHEMA_GROUP, name="scheduler", node=Schedule)
