"""Every method resumes bitwise: a run resumed from the uninterrupted run's own step-2 checkpoint ends at step 4
with the same weights, buffers, optimizer state and LR-schedule state, bit for bit (the sft case of
tests/data/test_data_resume.py, for every method, with weight decay and a warm-up schedule whose lr moves)."""

from __future__ import annotations

import functools
import importlib
import pkgutil

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import moe_lab.methods
from moe_lab.methods.base import MoELightningModule
from moe_lab.methods.slice_decay import sliced_weight_decay
from tests.conftest import ROOT, build_tiny
from tests.data.test_data_resume import chat_datamodule, train, write_chat_file

STEPS = 4
CLIP = {"gradient_clip_val": 1.0}  # as task=finetune
# weight decay on, and an lr that changes every step (1-step warm-up from 0, then cosine)
TASK = ["task.optim.lr=1e-2", "task.optim.weight_decay=0.1", "task.scheduler.name=cosine",
        "task.scheduler.warmup_steps=1"]
# method overrides per case (conf/method names; the condenser picks its condensers after 2 pre-phase micro-batches)
CASES = {name: [f"method={name}"] for name in ("sft", "frozen_router", "sft_aux_free", "esft_gate", "esft_token",
                                               "densemixer", "compressed_experts")}
CASES["condenser"] = ["method=condenser", "method.options.selection_updates=2"]
# the public code's per-micro-batch bias update, with 2 micro-batches per optimizer step: the update of the
# micro-batch that ends a step must be in that step's checkpoint (issue 21 item 12). condenser_bias=updating (as the
# public code): with budget=replace the condensers then take every token and every update moves all biases (frozen
# condenser biases would leave the others, which get no tokens, unchanged, and a missed update unseen in them)
CASES["condenser_micro_batch"] = [*CASES["condenser"], "method.options.update_every=micro_batch",
                                  "method.options.condenser_bias=updating"]
ACCUMULATE = {"condenser_micro_batch": 2}
CASES["sft_lora"] = ["method=sft", "method.lora={rank:4,alpha:8}"]
CASES["esft_token_lora"] = ["method=esft_token", "method.options.experts={0:[0,2,3],1:[1,5]}",
                            "method.lora={rank:4,alpha:8}"]


@functools.cache
def _config(case: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*CASES[case], *TASK])


def _module(case: str):
    cfg = _config(case)
    return instantiate(cfg.method, model=build_tiny("olmoe"), optim=cfg.task.optim, scheduler=cfg.task.scheduler,
                       _recursive_=False)


def assert_bitwise_equal(a, b, where: str = "") -> None:
    """``a`` and ``b`` (nested dicts / lists / tensors / plain values) are equal, tensors by ``torch.equal``."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), \
            f"{where}: max |diff| {float((a.double() - b.double()).abs().max())}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _state(module, trainer) -> dict:
    return {"weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()}


@pytest.mark.parametrize("case", list(CASES))
def test_every_method_resumes_bitwise(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the resumed run's artefacts (esft_selection.json, condenser.json) go to its cwd
    chat = write_chat_file(tmp_path)
    make = functools.partial(_module, case)
    limits = {"max_steps": STEPS, "accumulate_grad_batches": ACCUMULATE.get(case, 1), **CLIP}
    straight = _state(*train(chat_datamodule(chat), make, ckpt_dir=str(tmp_path), save_every=STEPS // 2, **limits))
    module, trainer = train(chat_datamodule(chat), make, ckpt_path=str(tmp_path / f"step={STEPS // 2}.ckpt"),
                            **limits)
    resumed = _state(module, trainer)
    if case.startswith("condenser"):  # the router biases and their update count, named before the whole state
        biases = {k: v for k, v in straight["weights"].items() if k.endswith((".mlp.bias", ".mlp.bias_updates"))}
        assert biases, "no router biases found"
        if case == "condenser_micro_batch":  # 2 pre-phase updates + one per micro-batch: 3 per epoch (windows 2, 1)
            assert [int(v) for k, v in biases.items() if k.endswith("bias_updates")] == [2 + 6] * 2
        assert_bitwise_equal(biases, {k: resumed["weights"][k] for k in biases}, f"{case} biases")
    assert straight["optimizer"]["state"], "nothing was trained"
    if case.startswith("esft"):  # the optimizer steps only the trained expert slices (leaf views of them)
        assert module.optimizer_layout == "sliced"
    assert_bitwise_equal(straight, resumed, case)


def test_no_method_module_changes_state_in_on_train_batch_end():
    """Lightning calls the callbacks' ``on_train_batch_end`` (which write the step's periodic, signal and last
    checkpoints) before the LightningModule's: state a method changed there would miss that step's checkpoint and not
    be replayed on resume (the condenser's micro-batch bias update did, issue 21). Per-micro-batch work belongs in
    ``on_after_backward``, per-step work in ``optimizer_step`` (``MoEPatch.step_hooks``)."""
    for info in pkgutil.iter_modules(moe_lab.methods.__path__):
        importlib.import_module(f"moe_lab.methods.{info.name}")
    modules, seen = [MoELightningModule], []
    while modules:
        cls = modules.pop()
        seen.append(cls)
        modules.extend(cls.__subclasses__())
    assert len(seen) > 3, seen  # sft's base, the condenser's, esft's, distill's ...
    offenders = [cls.__qualname__ for cls in seen if cls.on_train_batch_end is not L.LightningModule.on_train_batch_end]
    assert not offenders, f"on_train_batch_end overridden by {offenders}: it runs after the step's checkpoint"


def test_sliced_weight_decay_uses_the_current_lr_after_the_optimizer_state_is_loaded():
    """The root cause of ESFT's drift: ``optimizer.load_state_dict`` (a resume) replaces the param-group dicts,
    and the decay of the trained slices read its lr from the group dict of the optimizer as built (lr 0 under a
    warm-up). Oracle, by hand: with zero gradients Adam moves nothing, so a trained slice only decays,
    ``w *= 1 - lr_t * wd`` (AdamW's decay) with ``lr_t = 0.1 * t`` (a linear warm-up), and a frozen slice stays as it was."""
    weight = torch.nn.Parameter(torch.randn(3, 2, 2, generator=torch.Generator().manual_seed(0)))
    mask = torch.tensor([True, False, True])

    def build():
        optimizer = torch.optim.AdamW([{"params": [weight], "weight_decay": 0.0}], lr=1.0)
        sliced_weight_decay(optimizer, [(weight, mask)], 0.5)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 0.1 * t)

    def step(optimizer, scheduler):
        weight.grad = torch.zeros_like(weight)
        optimizer.step()
        scheduler.step()

    optimizer, scheduler = build()
    initial, expected = weight.detach().clone(), weight.detach().clone()
    for t in range(4):
        if t == 2:  # resume: a new optimizer and schedule loaded from the old ones' state
            states = optimizer.state_dict(), scheduler.state_dict()
            optimizer, scheduler = build()
            optimizer.load_state_dict(states[0])
            scheduler.load_state_dict(states[1])
        step(optimizer, scheduler)
        expected[mask] *= 1 - (0.1 * t) * 0.5
    assert torch.equal(weight.detach(), expected)
    assert not torch.equal(expected[mask], initial[mask]) and torch.equal(expected[~mask], initial[~mask])
