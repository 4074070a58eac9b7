"""``plan=true`` refuses what the run refuses before its first step, with the same message
(moe_lab/runtime/refusals.py: one function both call). Oracle: the run itself, on a tiny model on this CPU; the
plan builds the method on the meta model and must raise the run's message word for word."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

import run
from moe_lab.methods.base import MoELightningModule
from tests.presets import CONF

#: every config the run refuses before its first step: (overrides, a piece of the message). The sharded rows
#: keep the hardware setting's strategy and precision on the CPU (the refusal comes before any device is used).
CPU = ("hardware.trainer.accelerator=cpu", "hardware.trainer.devices=1")
REFUSED = {
    "esft_scored_on_fsdp": (("method=esft_token", "hardware=fsdp", *CPU),
                            "training only some expert slices (ESFT)"),
    "esft_given_on_fsdp": (("method=esft_token", "hardware=fsdp", "+method.options.experts={0:[1,2]}", *CPU),
                           "training only some expert slices (ESFT)"),
    "lora_on_fsdp": (("+experiment/row=densemixer_lora_conventional", "hardware=fsdp", *CPU),
                     "LoRA on packed experts is a torch parametrization"),
    "esft_fp16_decay_on_zero2": (("method=esft_token", "hardware=deepspeed_zero2", "task.optim.weight_decay=0.1",
                                  "hardware.trainer.precision=16-mixed", *CPU), "fp16's loss scaler may then skip"),
    "clip_by_value_on_fsdp": (("hardware=fsdp", "+task.trainer.gradient_clip_algorithm=value", *CPU),
                              "gradient_clip_algorithm=value under FSDP"),
    "negative_lr": (("task.optim.lr=-1",), "task.optim.lr=-1.0 must be > 0.0"),  # typed: a float
    "no_steps": (("task.trainer.max_steps=0",), "task.trainer.max_steps=0 must be >= 1"),
    "condenser_chosen_after_the_run": (("method=condenser", "method.options.n=1", "method.options.selection=in_run",
                                        "method.options.selection_updates=6"),
                                       "they would be chosen after the last step and never train"),
    "condenser_never_chosen": (("method=condenser", "method.options.n=1", "method.options.selection=in_run",
                                "method.options.selection_updates=9", "method.options.update_every=micro_batch",
                                "task.trainer.accumulate_grad_batches=1"), "they would never be chosen"),
}


def _refusal(tmp_path, name: str, overrides, *extra) -> str:
    over = ["model=tiny_olmoe", "debug=fast", "logger=none", f"paths.output_dir={tmp_path / name}", *overrides,
            *extra]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=over)
    with pytest.raises(ValueError) as err:
        run.execute(cfg)
    return str(err.value)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_plan_refuses_what_the_run_refuses_with_its_message(case, tmp_path, monkeypatch):
    overrides, piece = REFUSED[case]
    monkeypatch.setattr(MoELightningModule, "training_step",
                        lambda *a, **k: pytest.fail(f"{case}: the run took a step before refusing"))
    refused_run = _refusal(tmp_path, "run", overrides)
    refused_plan = _refusal(tmp_path, "plan", overrides, "plan=true")
    assert piece in refused_run
    assert refused_plan == refused_run
