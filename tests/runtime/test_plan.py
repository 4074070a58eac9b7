"""``plan=true`` (moe_lab/runs/plan.py), the epoch-based preflight and the memory preflight
(moe_lab/runs/memory_fit.py).

Oracles: Lightning's own loop (optimizer steps of a real ``Trainer.fit``), torch's DistributedSampler (rows per
rank), hand-computed schedule values, and the tiny-sibling run of a preset (its global step and data counts are
what the plan of the same config predicted).
"""

from __future__ import annotations

import json
import logging
import math

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import run
from moe_lab.data.resumable import ResumableSampler
from moe_lab.runs import memory_fit
from moe_lab.runs.checks import preflight
from moe_lab.runs.plan import optimizer_steps, schedule_points
from moe_lab.runtime.preflight import check_length
from tests.presets import CONF, compose_preset, data_overrides, preset_rows, real_model_presets

#: the D2D presets prune and distil a DENSE Qwen3-32B: moe-lab's memory estimate (analysis/estimate) models MoE
#: architectures only, so plan=true refuses them naming the missing MoE field; not planned here (issue 18's D2D
#: baseline postdates plan=true)
DENSE_PRESETS = ("moe_to_dense/d2d_qwen3_32b", "moe_to_dense/d2d_distill_qwen3_32b")
PRESETS = [p for p in real_model_presets() if p not in DENSE_PRESETS]


# --------------------------------------------------------------------------------------------------------------
# optimizer steps: Lightning's loop and torch's sampler are the oracles


class _Linear(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("rows,batch,accumulate,epochs,max_steps", [
    (10, 3, 2, 3, -1),   # 4 micro-batches an epoch, a step every 2: 2 an epoch
    (7, 2, 3, 2, -1),    # 4 micro-batches, accumulation 3: the epoch's last step takes the remaining 1
    (10, 3, 2, -1, 5),   # step-based
    (10, 3, 2, 3, 4),    # both: max_steps ends it first
    (5, 8, 64, 2, -1),   # fewer rows than a batch, accumulation longer than the epoch: 1 step an epoch
])
def test_optimizer_steps_are_lightnings(rows, batch, accumulate, epochs, max_steps, tmp_path):
    data = DataLoader(TensorDataset(torch.zeros(rows, 2)), batch_size=batch)
    trainer = L.Trainer(accelerator="cpu", max_epochs=epochs, max_steps=max_steps, accumulate_grad_batches=accumulate,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Linear(), data)
    got = optimizer_steps(rows, batch, accumulate, 1, epochs, max_steps)
    assert got["optimizer_steps"] == trainer.global_step
    assert got["micro_batches_per_epoch"] == len(data)


@pytest.mark.parametrize("rows,world", [(10, 4), (9, 3), (3, 8)])
def test_rows_per_rank_follow_the_samplers(rows, world):
    data = TensorDataset(torch.zeros(rows, 1))
    per_rank = {len(DistributedSampler(data, num_replicas=world, rank=r)) for r in range(world)}
    ours = {len(ResumableSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0)) for r in range(world)}
    assert per_rank == ours == {math.ceil(rows / world)}
    got = optimizer_steps(rows, 2, 1, world, 1, -1)
    assert got["micro_batches_per_epoch"] == math.ceil(math.ceil(rows / world) / 2)
    assert got["sequences_per_step"] == 2 * world


def test_schedule_points_by_hand():
    # OLMoE on Math7K as planned: 26 steps, warm-up ratio 0.03 -> ceil(0.78) = 1 step, linear to 0 at step 26
    s = schedule_points(26, OmegaConf.create({"name": "linear", "warmup_steps": 0, "warmup_ratio": 0.03,
                                              "min_lr_ratio": 0.0}))
    assert s["warmup_steps"] == 1
    assert dict(s["points"]) == pytest.approx({0: 0.0, 1: 1.0, 6: 20 / 25, 13: 13 / 25, 19: 7 / 25, 25: 1 / 25})


# --------------------------------------------------------------------------------------------------------------
# the preflight: epoch-based runs pass, a run without an end is refused


def _lengths(steps, epochs):
    return OmegaConf.create({"task": {"name": "finetune", "trainer": {"max_steps": steps, "max_epochs": epochs}}})


@pytest.mark.parametrize("steps,epochs", [(-1, 2), (1000, -1), (10, 2), (-1, 1)])
def test_epoch_or_step_based_runs_pass(steps, epochs):
    check_length(_lengths(steps, epochs))


@pytest.mark.parametrize("steps,epochs,message", [
    (-1, -1, "would never end"),
    (0, 2, "trains nothing"),
    (-5, 2, "max_steps=-5 must be >= 1, or -1"),
    (-1, 0, "max_epochs=0 must be >= 1"),
    ("1k", 2, "is not a number"),
])
def test_runs_without_an_end_are_refused(steps, epochs, message):
    with pytest.raises(ValueError, match=message):
        check_length(_lengths(steps, epochs))


# --------------------------------------------------------------------------------------------------------------
# the memory preflight (item 5), with a mocked device


def _gpu_run(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=["experiment=condenser/math_olmoe", *overrides])


@pytest.fixture
def h100(monkeypatch):
    """A machine with 8 CUDA GPUs of 80 GB (mocked: no GPU is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(memory_fit, "_cuda_memory_gb", lambda: (80.0, "mock 80 GB GPU"))


def _forbid_loading(monkeypatch):
    """``load_model`` fails the test wherever it is called from: every moe_lab module (the tasks and the
    library runs behind them) is imported first and its own name patched too (a module first imported while
    ``moe_lab.models.load_model`` is patched would otherwise keep the patch after the test, and fail the later
    tests of the same process)."""
    import importlib
    import pkgutil

    import moe_lab
    import moe_lab.models

    def fail(*args, **kwargs):
        pytest.fail("weights loaded")

    modules = [importlib.import_module(info.name)  # imported before anything is patched
               for info in pkgutil.walk_packages(moe_lab.__path__, "moe_lab.")]
    monkeypatch.setattr(moe_lab.models, "load_model", fail)
    for module in modules:
        if hasattr(module, "load_model"):
            monkeypatch.setattr(module, "load_model", fail)


def test_run_that_does_not_fit_is_refused_before_loading(h100, monkeypatch):
    _forbid_loading(monkeypatch)
    cfg = _gpu_run("hardware=gpu")  # one GPU holding all of OLMoE-7B's training state
    est = memory_fit.memory_estimate(cfg, 1, 8)
    assert est["gpu_gb"] > 80 and est["hardware"] == "gpu"
    with pytest.raises(ValueError) as err:
        preflight(cfg)
    message = str(err.value)
    assert f"{est['gpu_gb']:.1f} GiB per GPU" in message and "80 GiB of this GPU (mock 80 GB GPU)" in message
    fits = [f"hardware={name} ({gb:.1f} GiB)" for name, gb in est["options"] if gb <= 80]
    named = message.split("that fit")[1]
    assert fits and all(f in named for f in fits) and "hardware=gpu " not in named
    preflight(_gpu_run("hardware=deepspeed_zero3"))  # a setting the message named: passes
    preflight(_gpu_run())  # the preset's own hardware (ZeRO-2 on 8 GPUs) fits too


def test_memory_estimate_is_task_estimates_row():
    """The preflight's number is ``task=estimate``'s row for the run's method, strategy and checkpointing."""
    from moe_lab.analysis.estimate import Options, architecture_config, estimate

    # checkpointing on: the estimate's activations without it differ by ~0.1% from one call to the next (its
    # meta-device measurement of saved tensors), with it they are reproducible to the byte
    cfg = _gpu_run("hardware=deepspeed_zero2", "method=densemixer", "method.gradient_checkpointing=true")
    est = memory_fit.memory_estimate(cfg, 8)
    full = estimate(architecture_config(cfg.model), seq_len=4096, batch=4, opts=Options(), gpus=8,
                    with_student=False)
    [row] = [r for r in full["methods"]["densemixer"]["memory"]
             if r["strategy"] == "zero2" and r["activation_checkpointing"]]
    assert (est["method"], est["strategy"], est["gpu_gb"]) == ("densemixer", "zero2", row["gpu_total_gb"])
    assert {name for name, _ in est["options"]} == {"gpu_ddp", "deepspeed_zero2", "deepspeed_zero3",
                                                    "deepspeed_zero3_offload", "fsdp", "gpu_ep",
                                                    "gpu_ep hardware.ep_dense=ddp"}  # every one runs it
    esft = memory_fit.memory_estimate(_gpu_run("hardware=deepspeed_zero2", "method=esft_token"), 8)
    assert "fsdp" not in dict(esft["options"]) and {"deepspeed_zero3", "gpu_ep"} <= set(dict(esft["options"]))


def test_cpu_runs_are_never_refused_for_memory(h100):
    memory_fit.check_memory(_gpu_run("hardware=cpu", "model=tiny_olmoe"))


# --------------------------------------------------------------------------------------------------------------
# plan=true (item 6)


def _plan(preset, tmp_path, *extra, n=64):
    base = compose_preset(preset)
    over = [f"experiment={preset}", "plan=true", f"paths.output_dir={tmp_path / 'run'}",
            *data_overrides(base, tmp_path / "data", n=n, resize=False), *extra]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=over)
    return run.execute(cfg)


def test_plan_loads_nothing_and_trains_nothing(tmp_path, monkeypatch, capsys):
    import moe_lab.tasks

    _forbid_loading(monkeypatch)
    monkeypatch.setattr(moe_lab.tasks, "run_task", lambda *a, **k: pytest.fail("task run"))
    monkeypatch.setattr(L.Trainer, "fit", lambda *a, **k: pytest.fail("trained"))
    summary = _plan("condenser/math_olmoe", tmp_path, "method=condenser")
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["length"] == summary["length"]
    assert "no weights loaded" in out and f"output directory: {tmp_path / 'run'}" in out
    # 64 rows, val 5% = 3 -> 61 train rows over 8 GPUs: 8 per rank, 4 per micro-batch -> 2 micro-batches an epoch;
    # accumulation 8: 1 step an epoch (at its end), 2 epochs; 4 x 8 x 8 = 256 sequences a step
    assert summary["data"]["train_examples"] == 61 and summary["world_size"] == 8
    assert summary["length"] == {"micro_batches_per_epoch": 2, "steps_per_epoch": 1, "optimizer_steps": 2,
                                 "epochs": 2.0, "sequences_per_step": 256}
    # issue 17: the condensers are chosen before step 0 (20 updates of 8 accumulated micro-batches), not never
    assert "before step 0 by a forward-only pre-phase: 20 bias updates x 8 micro-batch(es) per rank" in out
    assert "ESTIMATE" in summary["tokenizer"]  # OLMoE's tokenizer is not here: byte counts, said so
    assert summary["memory"]["device_gb"] == 80.0 and "fits" in out and summary["memory"]["gpu_gb"] <= 80


def test_plan_refuses_what_a_run_refuses(tmp_path):
    with pytest.raises(ValueError, match="would never end"):
        _plan("condenser/math_olmoe", tmp_path, "task.trainer.max_epochs=-1")
    with pytest.raises(ValueError, match="method=esft_token under hardware=fsdp"):
        _plan("condenser/math_olmoe", tmp_path, "method=esft_token", "+method.options.experts={1: [0, 1]}",
              "hardware=fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_every_row_of_every_preset_plans_on_the_papers_node(preset, tmp_path, capsys):
    """Offline, from the typed-in architecture, no weights. Each job of ``python run.py -m experiment=<preset>`` (one per row of the paper's table: the preset's
    hydra.sweeper.params) is planned: none is refused, and a training row's hardware fits 8 x 80 GiB by moe-lab's
    estimate, which the plan names."""
    for i, row in enumerate(preset_rows(preset)):
        summary = _plan(preset, tmp_path / str(i), *row, n=16)
        out = capsys.readouterr().out
        assert "nothing loaded, nothing trained" in out and "output directory:" in out
        assert summary["architecture"].startswith("model.architecture")  # the real model's typed-in config.json
        assert "DOES NOT FIT" not in out, (preset, row)
        if "length" in summary:
            memory = summary["memory"]
            assert summary["length"]["optimizer_steps"] >= 1, (preset, row)
            assert summary["world_size"] == 8 and 0 < memory["gpu_gb"] <= 80 == memory["device_gb"], (preset, row)
            assert f"hardware={memory['hardware']}" in out and "fits" in out, (preset, row)
            assert all(where for _, where in summary["eval"]), (preset, row)


@pytest.mark.slow
@pytest.mark.parametrize("preset,quoted,total,active", [("condenser/math_dsv2lite", "DeepSeek-V2-Lite", 15.7, 2.4),
                                                        ("condenser/math_gptoss", "GPT-OSS-20B", 20.9, 3.6)])
def test_plan_prints_both_parameter_counts_and_says_which_the_paper_quotes(preset, quoted, total, active, tmp_path,
                                                                           capsys):
    """Oracle: the Expert Condenser paper's table (DeepSeek-V2-Lite 16B / 2.4B active, GPT-OSS 20B / 3.6B) and
    the models' config.json (input embedding = vocab_size x hidden_size): the published active count is moe-lab's
    without the input embedding; the memory is in GiB."""
    summary = _plan(preset, tmp_path)
    out = capsys.readouterr().out
    p, arch = summary["parameters"], compose_preset(preset).model.architecture
    assert p["input_embedding"] == arch.vocab_size * arch.hidden_size
    # the published figures have one decimal (DeepSeek's 2.45B reads 2.4B): within 0.1, and the nearer of the two
    assert round(p["total"] / 1e9, 1) == total and abs(p["active_no_input_embedding"] / 1e9 - active) < 0.1
    assert abs(p["active"] / 1e9 - active) > 0.2  # with the input embedding it is not the paper's number
    assert (f"active per token {p['active'] / 1e9:.2f}B counting the input embedding" in out
            and f"{p['active_no_input_embedding'] / 1e9:.2f}B without it" in out)
    assert f"{quoted} {active}B" in out.split("without it: ")[1].split("\n")[0]  # and says the paper's is that one
    assert f"memory: {summary['memory']['gpu_gb']:.1f} GiB per GPU" in out and " GB" not in out.split("memory:")[1]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["compressed_experts/olmoe", "condenser/math_qwen1_5", "esft/dsv2lite"])
def test_plan_predicts_the_run(preset, tmp_path):
    """The plan of the tiny-sibling run of a preset gives the optimizer steps and data counts the run then has."""
    from tests.test_presets_run import preset_overrides

    over = [f"experiment={preset}", *preset_overrides(preset, tmp_path)]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        planned = run.execute(compose(config_name="config", overrides=[*over, "plan=true"]))
        done = run.execute(compose(config_name="config", overrides=over))
    assert planned["length"]["optimizer_steps"] == done["global_step"]
    counts = planned["data"]["overflow"]["train"]
    assert done["data"]["train"] == {"kept": counts.get("kept", 0), "truncated": counts.get("truncated", 0),
                                     "dropped": counts.get("too_long", 0) + counts.get("no_labels", 0)}


def test_memory_preflight_of_a_top1_family(h100, caplog):
    """Llama 4 routes top-1: Compressed Experts (k_main in 1..k-1) is undefined there. The memory preflight of an
    sft run on one GPU estimates every method's row; it crashed on that one (H100 run: `model=tiny_llama4_text
    hardware=deepspeed_zero3` died with "task.methods.k_main=None must be in 1..top_k-1"). The row is left out,
    and a run that asks for that method is refused by name."""
    cfg = _gpu_run("model=tiny_llama4_text", "hardware=deepspeed_zero3", "hardware.trainer.devices=1")
    memory_fit._estimate.cache_clear()  # the line is logged when the estimate is computed, not when it is cached
    with caplog.at_level(logging.INFO, logger="moe_lab.analysis.estimate"):
        memory_fit.check_memory(cfg)
    assert "estimate: no compressed_experts row (a top-1 router has no auxiliary expert to compress)" in caplog.messages
    assert memory_fit.memory_estimate(cfg, 1)["gpu_gb"] > 0
    with pytest.raises(ValueError, match="compressed_experts is not defined for this model's routing"):
        memory_fit.memory_estimate(_gpu_run("model=tiny_llama4_text", "method=compressed_experts"), 1)


def test_plan_under_expert_parallelism_shows_the_ep_memory_and_all_to_all(tmp_path, capsys):
    """hardware=gpu_ep (EP8 over 8 GPUs, DDP for the dense part): the plan's memory is the estimate's ep row, with the
    all-to-all volume per micro-batch; a method that cannot run under EP is refused there, as in the run."""
    summary = _plan("condenser/s1_qwen3", tmp_path, "hardware=gpu_ep", "method=condenser")
    out = capsys.readouterr().out
    memory = summary["memory"]
    assert memory["strategy"] == "ep" and memory["hardware"] == "gpu_ep" and memory["ep_size"] == 8
    assert dict(memory["options"])["gpu_ep"] == pytest.approx(memory["gpu_gb"])
    assert f"all-to-all {memory['all_to_all_gb']:.2f} GiB sent per rank per micro-batch" in out
    assert "expert parallel: EP groups of 8 ranks" in out
    # the paper-scale rows fit 8 x 80 GB under EP8 once the dense part's moments are sharded (ZeRO-1), not without
    assert memory["gpu_gb"] < 80 and "DOES NOT FIT" not in out
    densemixer = _plan("condenser/s1_qwen3", tmp_path / "dm", "hardware=gpu_ep", "method=densemixer")["memory"]
    assert densemixer["strategy"] == "ep" and densemixer["gpu_gb"] < 80
    whole = dict(memory["options"])["gpu_ep hardware.ep_dense=ddp"]
    assert whole > 80 > memory["gpu_gb"]
    with pytest.raises(ValueError, match="method=compressed_experts under hardware.ep_size=8: .*gate_up_intermediate"):
        _plan("condenser/s1_qwen3", tmp_path / "ce", "hardware=gpu_ep", "method=compressed_experts",
              "method.options.form=gate_up_intermediate")


@pytest.mark.parametrize("model", ["tiny_deepseek_v32", "tiny_glm_moe_dsa"])
def test_plan_of_a_sparse_attention_family_has_its_memory_row(model, tmp_path):
    """plan=true on DeepSeek-V3.2 / GLM-MoE-DSA, through run.execute as `python run.py model=<m> plan=true` does:
    the memory estimate measures their meta forward with an explicit mask (it raised before)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}", "plan=true", "debug=fast",
                                                        f"paths.output_dir={tmp_path / 'run'}"])
    summary = run.execute(cfg)
    assert summary["memory"]["gpu_gb"] > 0 and summary["length"]["optimizer_steps"] > 0
