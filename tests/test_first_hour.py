"""A new user's first hour, in process: errors that name the fix, checkpoints on signals, progress, plots."""

from __future__ import annotations

import json
import logging
import os
import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import OmegaConf

from moe_lab.analysis import plots
from moe_lab.callbacks import ExpertLoadCallback
from moe_lab.callbacks.progress import ProgressLog, StepProgressBar
from moe_lab.data.resumable import ResumableDataLoader
from moe_lab.data.sources import open_dataset
from moe_lab.eval.results import ResultsTable, collect, expand_runs
from moe_lab.eval.results import main as results_main
from moe_lab.runtime.checkpoint_io import (
    AtomicCheckpointIO,
    CheckpointOnSignal,
    check_matches,
    read_checkpoint,
)
from moe_lab.runtime.preflight import check_hardware, check_numbers, check_wandb
from moe_lab.sweep_summary import record_failure, sweep_rows, write_sweep_summary
from tests.callbacks.conftest import TinyModule, loader, random_batches
from tests.conftest import ROOT

# --------------------------------------------------------------------------------------------------
# Config checks up front


def _cfg(**overrides):
    cfg = OmegaConf.create({
        "task": {"name": "finetune", "trainer": {"max_steps": 1000, "log_every_n_steps": 5, "val_check_interval": 250,
                                                 "accumulate_grad_batches": 1},
                 "checkpoint_every_n_steps": 250, "optim": {"lr": 3e-3, "weight_decay": 0.01},
                 "scheduler": {"warmup_steps": 10}},
        "dataset": {"batch_size": 8, "max_length": 512},
        "hardware": {"trainer": {"accelerator": "cpu"}},
    })
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def test_valid_defaults_pass():
    check_numbers(_cfg())


@pytest.mark.parametrize("field,value,expected", [
    ("task.trainer.max_steps", "1k", "is not a number"),
    ("task.trainer.max_steps", 0, "trains nothing"),
    ("task.trainer.max_steps", 2.5, "whole number"),
    ("task.optim.lr", -1.0, "must be > 0"),
    ("task.optim.lr", 0.0, "must be > 0"),
    ("dataset.batch_size", 0, "must be >= 1"),
    ("task.checkpoint_every_n_steps", -5, "must be >= 1"),
    ("task.trainer.val_check_interval", 0, "number of training batches"),
])
def test_bad_numbers_name_the_field(field, value, expected):
    with pytest.raises(ValueError) as err:
        check_numbers(_cfg(**{field: value}))
    assert f"{field}={value}" in str(err.value) or f"{field}={value!r}" in str(err.value)
    assert expected in str(err.value)


def test_validation_interval_under_accumulation_is_stated_in_optimizer_steps(caplog):
    """Lightning counts val_check_interval in training batches (micro-batches): under accumulation the run says
    how many optimizer steps that is, in one line."""
    with caplog.at_level(logging.INFO, logger="moe_lab.runtime.preflight"):
        check_numbers(_cfg(**{"task.trainer.accumulate_grad_batches": 4}))
    assert [r.getMessage() for r in caplog.records] == [
        ("task.trainer.val_check_interval=250 counts training batches: with accumulate_grad_batches=4 validation "
        "runs every 62.5 optimizer steps")]


def test_gpu_hardware_without_cuda_suggests_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="use hardware=cpu"):
        check_hardware(_cfg(**{"hardware.trainer.accelerator": "gpu"}))
    check_hardware(_cfg())  # cpu is fine


def test_wandb_without_key_falls_back_to_offline_at_once(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    cfg = OmegaConf.create({"logger": {"wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger",
                                                 "offline": False}}})
    with caplog.at_level("WARNING"):
        check_wandb(cfg)
    assert os.environ["WANDB_MODE"] == "offline"
    assert "WANDB_MODE=offline" in caplog.text and "no W&B API key" in caplog.text


def test_wandb_unreachable_falls_back_to_offline(monkeypatch, caplog):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "https://127.0.0.1:9")  # nothing listens on the discard port
    cfg = OmegaConf.create({"logger": {"wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger"}}})
    with caplog.at_level("WARNING"):
        check_wandb(cfg, timeout_s=1.0)
    assert os.environ["WANDB_MODE"] == "offline" and "unreachable" in caplog.text


def test_missing_pretrained_path_says_it_does_not_exist(tmp_path):
    from moe_lab.models import load_model

    missing = tmp_path / "OLMoE-1B-7B"
    with pytest.raises(FileNotFoundError) as err:
        load_model({"name": "olmoe", "pretrained": str(missing)})
    assert f"model.pretrained={missing}: this path does not exist" in str(err.value)


# --------------------------------------------------------------------------------------------------
# Data


@pytest.mark.parametrize("content", ["", "  \n", "[]"])
def test_empty_dataset_file_is_named(tmp_path, content):
    path = tmp_path / "train.json"
    path.write_text(content)
    with pytest.raises(ValueError) as err:
        open_dataset(str(path))
    assert str(path) in str(err.value) and "is empty" in str(err.value)


def test_missing_relative_data_path_mentions_moe_lab_data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="MOE_LAB_DATA_DIR"):
        open_dataset("../elsewhere/llm_adapters/math_data.json")


def test_math_data_config_keeps_most_examples_with_the_byte_tokenizer():
    """conf/dataset/math_data.yaml: the default tiny model (byte tokenizer) keeps >= 90% of math_data.json."""
    from hydra.utils import instantiate

    from moe_lab.data.tokenizer import build_byte_tokenizer
    from tests.conftest import DATA_DIR

    cfg = OmegaConf.load(ROOT / "conf" / "dataset" / "math_data.yaml")
    base = OmegaConf.load(ROOT / "conf" / "dataset" / "llm_adapters.yaml")
    cfg = OmegaConf.merge(base, {k: v for k, v in cfg.items() if k != "defaults"})
    assert cfg.path == str(DATA_DIR / "math_data.json")  # the packaged copy (or $MOE_LAB_DATA_DIR's)
    cfg.path = str(DATA_DIR / "math_data.json")
    dm = instantiate(cfg, tokenizer=build_byte_tokenizer())
    dm.setup()
    counts = dm.overflow_counts["train"]
    total = sum(counts.values())
    dropped = counts["too_long"] + counts["no_labels"]
    assert total > 3000 and dropped / total < 0.10, counts


# --------------------------------------------------------------------------------------------------
# Checkpoints


def test_garbage_checkpoint_is_not_a_moe_lab_checkpoint(tmp_path):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(b"definitely not a checkpoint" * 10)
    with pytest.raises(ValueError) as err:
        read_checkpoint(bad, "task.ckpt_path")
    assert f"task.ckpt_path={bad}: torch cannot read it" in str(err.value)
    assert "truncated or corrupted" in str(err.value) and "No complete checkpoint beside it" in str(err.value)
    assert "weights_only" not in str(err.value)
    torch.save({"state_dict": {}}, bad)  # a torch file, but not one of ours
    with pytest.raises(ValueError, match="is not a moe-lab checkpoint"):
        read_checkpoint(bad)


def test_checkpoint_of_another_model_names_both(tmp_path):
    from moe_lab.methods.base import MoELightningModule
    from tests.conftest import build_tiny

    theirs = MoELightningModule(build_tiny("qwen3_moe"), "frozen_router", name="frozen_router")
    ours = MoELightningModule(build_tiny("olmoe"), "sft")
    path = tmp_path / "last.ckpt"
    ckpt = {"state_dict": theirs.state_dict(), "hyper_parameters": dict(theirs.hparams),
            "moe_lab": {"model": "tiny_qwen3_moe", "method": "frozen_router"}}
    with pytest.raises(ValueError) as err:
        check_matches(ckpt, path, ours, "tiny_olmoe / sft")
    assert "the checkpoint is tiny_qwen3_moe / frozen_router, the config is tiny_olmoe / sft" in str(err.value)
    check_matches({"state_dict": ours.state_dict()}, path, ours, "tiny_olmoe / sft")  # same model: fine


def test_interrupted_save_keeps_the_previous_last_ckpt(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1}, path)

    def half_written(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"global_step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"global_step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


class _SendSignal(L.Callback):
    def __init__(self, signum, at_step):
        self.signum, self.at_step = signum, at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)


def _fit(tmp_path, max_steps, callbacks=(), ckpt_path=None):
    L.seed_everything(0)
    module = TinyModule()
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=list(callbacks))
    data = ResumableDataLoader(random_batches(8), batch_size=None, shuffle=False)  # mid-epoch resume is exact
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, trainer


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("straight"), 6)[0].state_dict()


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT])
def test_signal_writes_a_checkpoint_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path, signum, straight):
    """Oracle: an uninterrupted 6-step run. Stopped by a signal after step 2 and resumed from the checkpoint
    the signal wrote, the weights are the same bit for bit."""
    ckpt = tmp_path / "b" / "last.ckpt"
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler; SIG_IGN in a pytest-xdist worker
    on_signal = CheckpointOnSignal(ckpt)
    with pytest.raises(SIGTERMException):
        _fit(tmp_path / "b", 6, [_SendSignal(signum, 2), on_signal])  # the signal comes during step 2
    assert on_signal.signum == signum and on_signal.saved == ckpt
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored after fit
    resumed, trainer = _fit(tmp_path / "c", 6, ckpt_path=str(ckpt))
    assert trainer.global_step == 6
    for key, value in straight.items():
        assert torch.equal(value, resumed.state_dict()[key]), key


# --------------------------------------------------------------------------------------------------
# Progress and wall time


def test_progress_bar_counts_steps_not_epochs(tmp_path, capsys):
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=5, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[StepProgressBar()])
    trainer.fit(TinyModule(), loader(random_batches(2)))  # 2 batches per epoch: 3 epochs
    bar = capsys.readouterr().out  # Lightning's tqdm writes to stdout
    assert "Epoch" not in bar and "-2" not in bar
    assert "train: 100%" in bar and "5/5" in bar and "it/s" in bar and "train/loss" in bar


def test_progress_log_lines_and_wall_time_across_resume(tmp_path, caplog):
    log = ProgressLog(every_n_steps=2)
    with caplog.at_level("INFO", logger="moe_lab.progress"):
        _fit(tmp_path, 4, [log])
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_lab.progress"]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert all("train/loss" in line and "it/s" in line and "eta" in line for line in lines)
    later = ProgressLog()
    later.load_state_dict({"wall_time_s": 100.0})
    later.on_fit_start(None, None)
    assert 100.0 <= later.wall_time_s < 101.0 and later.state_dict()["wall_time_s"] >= 100.0


# --------------------------------------------------------------------------------------------------
# Plots


def _capture_figures(monkeypatch):
    figures = []
    real = plots._save

    def save(fig, path):
        figures.append(fig)
        return real(fig, path)

    monkeypatch.setattr(plots, "_save", save)
    return figures


def test_loss_curve_log_scale(tmp_path, monkeypatch):
    figures = _capture_figures(monkeypatch)
    rows = [(s, 5.0 * 0.9 ** s) for s in range(50)]
    plots.loss_curve(rows, tmp_path / "lin.png")
    plots.loss_curve(rows, tmp_path / "log.png", log_scale=True)
    assert [f.axes[0].get_yscale() for f in figures] == ["linear", "log"]


def test_expert_load_heatmaps_share_one_colour_scale(tmp_path, monkeypatch):
    """Every snapshot's colour scale is [0, 1/top_k] (the most an expert can take of a layer's slots), so
    heatmaps of a run compare; the colorbar limits of the saved figures are read back."""
    figures = _capture_figures(monkeypatch)
    callback = ExpertLoadCallback(log_every_n_steps=0, heatmap_every_n_steps=2, plot_dir=tmp_path)
    module, _ = _fit(tmp_path, 6, [callback])
    top_k = module.patch.layers[0].top_k
    limits = [f.axes[0].images[0].get_clim() for f in figures]
    assert len(limits) == 3 and all(lim == (0.0, 1.0 / top_k) for lim in limits), limits


# --------------------------------------------------------------------------------------------------
# Sweep summary and results


def test_failed_job_gets_a_row_with_its_error(tmp_path):
    (tmp_path / "0_tiny_olmoe_sft").mkdir()
    (tmp_path / "0_tiny_olmoe_sft" / "summary.json").write_text(json.dumps(
        {"model": "tiny_olmoe", "method": "sft", "global_step": 3, "train/loss": 2.0, "step_time_median_s": 0.1}))
    cfg = OmegaConf.create({"model": {"name": "tiny_olmoe"}, "method": {"name": "condenser"}})
    record_failure(tmp_path / "1_tiny_olmoe_condenser", cfg, ValueError("task.optim.lr=-1.0 must be > 0\nmore"))
    rows = sweep_rows(tmp_path)
    assert [(r["job"], r["method"], r["error"]) for r in rows] == [
        ("0_tiny_olmoe_sft", "sft", None),
        ("1_tiny_olmoe_condenser", "condenser", "ValueError: task.optim.lr=-1.0 must be > 0")]
    md = write_sweep_summary(tmp_path).read_text()
    assert "| 1_tiny_olmoe_condenser | tiny_olmoe | condenser |" in md and "ValueError: task.optim.lr" in md


def _eval_run(path, model, method, value):
    table = ResultsTable()
    table.add(model, method, "GSM8K", value)
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"table": table.to_json(), "columns": table.columns}))


def test_results_accept_a_sweep_directory_and_skip_non_runs(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    _eval_run(sweep / "10_b_sft", "b", "sft", 20.0)
    _eval_run(sweep / "2_a_sft", "a", "sft", 10.0)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "summary.md").write_text("| x |\n")
    assert [p.name for p in expand_runs([sweep])] == ["2_a_sft", "10_b_sft"]
    assert [p.name for p in expand_runs(sorted(sweep.iterdir()))] == ["10_b_sft", "2_a_sft"]
    assert collect(expand_runs([sweep])).cells == {("a", "sft"): {"GSM8K": 10.0}, ("b", "sft"): {"GSM8K": 20.0}}
    assert results_main([str(p) for p in sorted(sweep.iterdir())]) == 0
    out = capsys.readouterr()
    assert "| a | sft | 10.0 |" in out.out and "multirun.yaml is not a run directory" in out.err


def test_progress_log_never_stays_silent_longer_than_max_silence(caplog):
    from types import SimpleNamespace

    log = ProgressLog(every_n_steps=100, max_silence_s=0.0)  # every step is "too long" since the last line
    trainer = SimpleNamespace(global_step=0, max_steps=1000, is_global_zero=True,
                              callback_metrics={"train/loss": torch.tensor(2.5)})
    log.on_fit_start(trainer, None)
    log.on_train_start(trainer, None)
    with caplog.at_level("INFO", logger="moe_lab.progress"):
        for step in (1, 2, 3):
            trainer.global_step = step
            log.on_train_batch_end(trainer, None, None, None, step - 1)
    assert [r.getMessage().split(" | ")[:2] for r in caplog.records] == [
        [f"step {s}/1000", "train/loss 2.5000"] for s in (1, 2, 3)]
    quiet = ProgressLog(every_n_steps=100, max_silence_s=3600.0)
    quiet.on_train_start(trainer, None)
    trainer.global_step = 4
    caplog.clear()
    quiet.on_train_batch_end(trainer, None, None, None, 3)
    assert caplog.records == []


def test_debug_fast_with_no_callbacks_instantiates_none():
    """debug=fast tunes callbacks.expert_load; with callbacks=none that leftover has no _target_ to build."""
    from hydra import compose, initialize_config_dir

    from moe_lab.runtime.trainer import instantiate_all

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["debug=fast", "callbacks=none"])
    assert "_target_" not in cfg.callbacks.expert_load
    assert instantiate_all(cfg.callbacks) == []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["debug=fast"])
    assert any(type(c).__name__ == "ExpertLoadCallback" for c in instantiate_all(cfg.callbacks))


def test_resume_in_the_same_directory_keeps_updating_last_ckpt(tmp_path):
    """A signal checkpoint written before any periodic one leaves last.ckpt unknown to ModelCheckpoint's state;
    the resumed run must overwrite last.ckpt (not start last-v1.ckpt), or a second resume would go back."""
    from moe_lab.runtime.checkpoint_io import checkpoint_callback

    ckpt_dir = tmp_path / "checkpoints"

    def fit(max_steps, callbacks, ckpt_path=None):
        L.seed_everything(0)
        trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path,
                            callbacks=[checkpoint_callback(ckpt_dir, every_n_train_steps=3), *callbacks])
        trainer.fit(TinyModule(), ResumableDataLoader(random_batches(8), batch_size=None, shuffle=False),
                    ckpt_path=ckpt_path)

    with pytest.raises(SIGTERMException):
        fit(6, [_SendSignal(signal.SIGUSR1, 2), CheckpointOnSignal(ckpt_dir / "last.ckpt")])
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == 2
    fit(7, [], ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert sorted(p.name for p in ckpt_dir.glob("*.ckpt")) == ["last.ckpt"]
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == 6  # every 3 steps


@pytest.mark.parametrize("dataset, shortened", [
    (None, {"num_examples": 64, "max_length": 384}),
    ("text", {"num_blocks": 64, "val_blocks": 4}),
])
def test_debug_fast_shortens_the_keys_the_chosen_dataset_has(dataset, shortened):
    """debug=fast shortens any dataset group (a text dataset has no num_examples: it used to fail to build), and a
    key given on the command line wins."""
    from hydra import compose, initialize_config_dir

    import run

    given = [f"dataset={dataset}"] if dataset else []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["debug=fast", *given, "dataset.batch_size=3"])
        default = compose("config", overrides=given)
    run.shorten_dataset(cfg, ["debug=fast", *given, "dataset.batch_size=3"])
    got = OmegaConf.to_container(cfg.dataset)
    for key, value in OmegaConf.to_container(default.dataset).items():
        assert got[key] == shortened.get(key, 3 if key == "batch_size" else value), key
    key = next(iter(shortened))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["debug=fast", *given, f"dataset.{key}=7"])
    run.shorten_dataset(cfg, ["debug=fast", *given, f"dataset.{key}=7"])
    assert cfg.dataset[key] == 7


def test_an_eval_group_on_a_training_run_is_said_not_run(tmp_path, caplog):
    """``python run.py dataset=math_data eval=math7 eval.limit=20`` trains and exports; the eval group is not run by
    task=finetune, and one line says so with the command that evaluates the export (it was silently unused)."""
    import logging

    from hydra import compose, initialize_config_dir

    from moe_lab.runs.training import say_eval_not_run

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["eval=math7", "eval.limit=20"])
        quiet = compose("config")
    with caplog.at_level(logging.WARNING, logger="moe_lab.runs.training"):
        say_eval_not_run(quiet, tmp_path)
        assert not caplog.messages
        say_eval_not_run(cfg, tmp_path)
    want = ("eval=math7: task=finetune trains and exports, it does not evaluate; evaluate this run's export with: "
            f"python run.py task=evaluate eval=math7 eval.limit=20 model=tiny_olmoe task.checkpoint={tmp_path / 'export'}")
    assert caplog.messages == [want]
