"""task=moe_to_dense end to end on a tiny model (few steps), and the paper's two initialisation baselines."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from moe_lab.compress.calibration import calibrate
from moe_lab.compress.dense import export_compressed, to_dense
from moe_lab.models import load_model
from moe_lab.tasks.moe_to_dense import ffn_names, reinitialise
from tests.conftest import ROOT, build_tiny, random_batch, word_text


def _text(path, n, seed):
    return word_text(path, n, seed=seed, vocab=9)


def _cfg(tmp_path, *overrides):
    train, test = _text(tmp_path / "train.txt", 40, 0), _text(tmp_path / "test.txt", 4, 1)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[
            "task=moe_to_dense", "model=tiny_qwen3_moe", f"paths.output_dir={tmp_path / 'run'}", "logger=csv",
            "dataset=text", f"dataset.path={train}", "dataset.block_size=32", "dataset.batch_size=2",
            "dataset.streaming=false", f"compress.calibration.dataset.path={train}",
            "compress.calibration.num_sequences=4", "compress.calibration.seq_len=32", "compress.K=4",
            f"compress.eval.path={test}", "compress.eval.max_length=32", "compress.eval.stride=32",
            "task.trainer.max_steps=2", "task.scheduler.warmup_steps=1", *overrides])


@pytest.mark.slow  # ~40 s on the shared CPU: three stages and two training steps
def test_pipeline_runs_all_stages(tmp_path):
    from moe_lab.tasks import run_task

    with pytest.raises(ValueError, match="add method=kd"):
        run_task(_cfg(tmp_path))
    summary = run_task(_cfg(tmp_path, "method=kd"))
    run = tmp_path / "run"
    assert (run / "calibrate" / "calibration.safetensors").is_file()
    assert json.loads((run / "convert" / "export" / "config.json").read_text())["model_type"] == "qwen3"
    assert summary["distill"]["global_step"] == 2 and (run / "distill" / "export" / "config.json").is_file()
    assert summary["pre_distill"]["status"] == summary["post_distill"]["status"] == "ok"
    assert summary["distill"]["kd/kl"] > 0 and (run / "plots" / "kd_kl.png").is_file()
    assert json.loads((run / "summary.json").read_text())["init"] == "converted"
    columns = (run / "distill" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "grad_norm/total" in columns  # the default callbacks run on the dense student (MoE ones do nothing)
    assert not [c for c in columns if c.startswith(("load/", "drift/"))]


@pytest.mark.parametrize("source", ["memory", "export"])
def test_baselines_reinitialise_ffn_or_everything(source, tmp_path):
    """``export``: the student as the task has it, reloaded by load_model (from_pretrained marks its tensors as
    initialised, which transformers' init functions would skip)."""
    teacher = build_tiny("qwen3_moe").eval()
    cal = calibrate(teacher, [random_batch(batch=2, seq=16, pad_rows=())])
    names = ffn_names(teacher, teacher.config.num_hidden_layers)
    assert names == [f"model.layers.{i}.mlp" for i in range(3)]
    converted = to_dense(teacher, cal, K=4).state_dict()
    if source == "export":
        export_compressed(to_dense(teacher, cal, K=4), tmp_path / "student")
    for init in ("random_ffn", "random"):
        student = to_dense(teacher, cal, K=4) if source == "memory" else load_model(
            {"pretrained": str(tmp_path / "student"), "tokenizer": "byte"}, method="kd")[0]
        reinitialise(student, names, init, seed=0)
        std = student.config.initializer_range
        for key, value in student.state_dict().items():
            changed = not torch.equal(value, converted[key])
            is_ffn = ".mlp." in key
            if init == "random_ffn":
                assert changed == is_ffn, key
            elif value.dim() == 2:
                assert changed, key
            if is_ffn:  # normal(0, initializer_range)
                assert abs(value.std().item() - std) < 0.25 * std, key
