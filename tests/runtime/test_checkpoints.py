"""Checkpoints: COMPLETED markers, keep-last-N, refusing half-written or other-strategy checkpoints, exact resume
under 2-process DDP, and a real DeepSpeed ZeRO-2/3 checkpoint (written by DeepSpeed's CPU engine) converted to a
vanilla HF export."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moe_lab.runtime.checkpoint_io import (
    MARKER,
    check_resumable,
    checkpoint_callback,
    content_digests,
    convert_zero_checkpoint,
    marker_path,
    read_checkpoint,
)
from tests.conftest import ROOT


class _Linear(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, keep_last, max_steps=6):
    callback = checkpoint_callback(tmp_path, every_n_train_steps=1, keep_last=keep_last)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, callbacks=[callback],
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Linear(), torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=2))
    return trainer


@pytest.mark.parametrize("keep_last", [0, 2])
def test_each_finished_checkpoint_is_marked_and_only_the_last_n_kept(tmp_path, keep_last):
    """Oracle: the names an every-step schedule must leave after 6 steps, written out by hand."""
    _fit(tmp_path, keep_last)
    expected = {"last.ckpt"} | ({"step-5.ckpt", "step-6.ckpt"} if keep_last else set())
    assert {p.name for p in tmp_path.glob("*.ckpt")} == expected
    assert {p.name for p in tmp_path.glob(f"*.{MARKER}")} == {f"{n}.{MARKER}" for n in expected}
    for name in expected:
        info = json.loads(marker_path(tmp_path / name).read_text())
        step = torch.load(tmp_path / name, weights_only=True)["global_step"]
        assert info == {"global_step": step, "strategy": "single", "world_size": 1,
                        "sha256": {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}}
        check_resumable(tmp_path / name, "task.ckpt_path", "single")


def test_keep_last_checkpoints_must_be_a_count(tmp_path):
    with pytest.raises(ValueError, match=r"task.keep_last_checkpoints=-1: give an integer >= 0"):
        checkpoint_callback(tmp_path, 1, -1)


def test_half_written_checkpoint_is_refused_naming_the_complete_ones(tmp_path):
    _fit(tmp_path, keep_last=2)
    marker_path(tmp_path / "last.ckpt").unlink()  # what a run killed while saving leaves
    with pytest.raises(ValueError) as err:
        check_resumable(tmp_path / "last.ckpt", "task.resume", "single")
    msg = str(err.value)
    assert msg.startswith(f"task.resume={tmp_path / 'last.ckpt'}: no {MARKER} marker") and "half-written" in msg
    assert "or the marker was deleted" in msg and "task.adopt_checkpoint=true" in msg
    assert "step-6.ckpt (step 6), step-5.ckpt (step 5)" in msg


def _marked_dir(tmp_path, strategy):
    ckpt = tmp_path / "last.ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("global_step2")
    (ckpt / MARKER).write_text(json.dumps({"global_step": 2, "strategy": strategy, "world_size": 8,
                                           "sha256": content_digests(ckpt)}))
    return ckpt


def test_checkpoint_of_another_strategy_is_refused_with_the_conversion_command(tmp_path):
    zero3 = _marked_dir(tmp_path, "deepspeed_zero3")
    check_resumable(zero3, "task.resume", "deepspeed_zero3")
    with pytest.raises(ValueError) as err:
        check_resumable(zero3, "task.resume", "ddp")
    msg = str(err.value)
    assert "written under deepspeed_zero3; this run uses ddp" in msg
    assert f"python -m moe_lab.runtime.checkpoint_io convert {zero3} <export dir>" in msg
    with pytest.raises(ValueError, match="resume with hardware=deepspeed_zero3"):
        check_resumable(zero3, "task.resume", "deepspeed_zero2")
    plain = tmp_path / "plain.ckpt"
    plain.write_bytes(b"x")
    marker_path(plain).write_text(json.dumps({"strategy": "ddp", "sha256": content_digests(plain)}))
    check_resumable(plain, "task.ckpt_path", "single")  # DDP and one process share the checkpoint format
    with pytest.raises(ValueError, match="written under ddp; this run uses fsdp"):
        check_resumable(plain, "task.ckpt_path", "fsdp")


def _compose(*overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))


def _run_py(*overrides, cwd):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def csv_rows(path) -> list[dict]:
    """metrics.csv as written: every row, every non-empty cell as its text."""
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if v} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_ddp_resume_from_a_kept_checkpoint_is_bitwise_exact(tmp_path):
    """Oracle: an uninterrupted 4-step run on 2 gloo processes. A second run continues its kept step=2 checkpoint
    to step 4; every weight and buffer equals the uninterrupted run's bit for bit, and so do its metrics.csv, row
    for row and cell for cell (no column is timing), and its heatmaps. The load window (3 steps) and the drift
    probe (each rank its own validation batch) straddle the checkpoint, so both continue across the resume."""
    common = ["debug=fast", "hardware=ddp_cpu", "logger=csv", "task.trainer.max_steps=4",
              "task.checkpoint_every_n_steps=2", "task.keep_last_checkpoints=2", "task.export=false",
              "callbacks.expert_load.log_every_n_steps=3", "callbacks.routing_drift.every_n_steps=3"]
    first, second = tmp_path / "a", tmp_path / "b"
    _run_py(*common, f"hydra.run.dir={first}", cwd=tmp_path)
    assert json.loads(marker_path(first / "checkpoints" / "step-2.ckpt").read_text())["strategy"] == "ddp"
    _run_py(*common, f"task.ckpt_path={first / 'checkpoints' / 'step-2.ckpt'}", f"hydra.run.dir={second}",
            cwd=tmp_path)
    straight = torch.load(first / "checkpoints" / "last.ckpt", weights_only=True)
    resumed = torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)
    assert straight["global_step"] == resumed["global_step"] == 4
    assert straight["state_dict"].keys() == resumed["state_dict"].keys()
    for key, value in straight["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key
    want, got = csv_rows(first / "metrics.csv"), csv_rows(second / "metrics.csv")
    assert {"load/gini_mean", "drift/kl_mean", "epoch"} <= {k for row in want for k in row}
    assert [r.get("step") for r in got] == [r.get("step") for r in want]
    for row, (a, b) in enumerate(zip(want, got)):
        assert a == b, (row, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)})
    for name in ("expert_load_step000003.png", "expert_load_step000004.png"):
        assert (first / "plots" / name).read_bytes() == (second / "plots" / name).read_bytes(), name


_WRITE_ZERO = '''
import os, sys
import torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from hydra.utils import instantiate
from omegaconf import OmegaConf
from moe_lab.models import load_model

stage, run = int(sys.argv[1]), sys.argv[2]
cfg = OmegaConf.load(f"{run}/config.yaml")
deepspeed.init_distributed(dist_backend="gloo")
model, _ = load_model(cfg.model)
module = instantiate(cfg.method, model=model, optim=cfg.task.optim, scheduler=cfg.task.scheduler, _recursive_=False)
opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config={  # the LightningModule, as Lightning does
    "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True})
ids = torch.arange(3, 19).view(2, 8)
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
engine.save_checkpoint(f"{run}/checkpoints/last.ckpt", tag="checkpoint", client_state={
    "global_step": 1, "hyper_parameters": dict(module.hparams),
    "moe_lab": {"model": cfg.model.name, "method": cfg.method.name}})
with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=stage == 3):
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, f"{run}/oracle.pt")
from types import SimpleNamespace
from lightning.pytorch.strategies import DeepSpeedStrategy
from moe_lab.runtime.strategies import gather_full_weights
gather_full_weights(SimpleNamespace(strategy=DeepSpeedStrategy(stage=stage), is_global_zero=True), module)
torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, f"{run}/gathered.pt")
'''


@pytest.mark.slow
@pytest.mark.parametrize("stage,method", [(2, "sft"), (3, "condenser")])
def test_real_zero_checkpoint_converts_to_a_vanilla_hf_export(tmp_path, stage, method):
    """DeepSpeed's own engine (CPU accelerator, gloo, one rank; the first run compiles DeepSpeed's shm op, about
    3 min) trains one step and saves a ZeRO checkpoint. Oracle: the engine's weights after that step, gathered
    with deepspeed.zero.GatheredParameters. The converted export loads in vanilla transformers with the same
    weights bit for bit; read_checkpoint gives every full shape (ZeRO-3 stores partitions); gather_full_weights
    puts the same whole tensors into the module (finetune's export after a ZeRO-3 fit)."""
    from transformers import AutoModelForCausalLM

    from moe_lab.methods.base import MoELightningModule  # noqa: F401 - the module class the script builds

    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(_compose(f"method={method}"), run / "config.yaml")
    script = tmp_path / "write_zero.py"
    script.write_text(_WRITE_ZERO)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(stage), str(run), str(29500 + 17 * stage)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    oracle = torch.load(run / "oracle.pt", weights_only=True)
    state = read_checkpoint(ckpt)
    assert state["global_step"] == 1
    assert {k: tuple(v.shape) for k, v in state["state_dict"].items()} == {k: tuple(v.shape) for k, v in oracle.items()}
    proc = subprocess.run([sys.executable, "-m", "moe_lab.runtime.checkpoint_io", "convert", str(ckpt),
                           str(tmp_path / "export")], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    gathered = torch.load(run / "gathered.pt", weights_only=True)  # what finetune exports after a ZeRO-3 fit
    assert all(torch.equal(gathered[k], v) for k, v in oracle.items())
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert exported and all(torch.equal(v, oracle[f"model.{k}"]) for k, v in exported.items())
    if method == "condenser":  # the fp32 router biases travel with the export
        assert (tmp_path / "export" / "condenser.json").is_file()


def test_convert_refuses_a_file_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    path.mkdir()
    with pytest.raises(ValueError, match="not a DeepSpeed checkpoint directory"):
        convert_zero_checkpoint(path, tmp_path / "out")


def test_resume_by_run_dir_finds_a_deepspeed_checkpoint_directory(tmp_path):
    from omegaconf import OmegaConf

    from moe_lab.runtime.resume import resume_checkpoint

    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)  # DeepSpeed writes last.ckpt as a directory
    cfg = OmegaConf.create({"task": {"resume": str(tmp_path), "ckpt_path": None}})
    assert resume_checkpoint(cfg) == (ckpt, "task.resume")
