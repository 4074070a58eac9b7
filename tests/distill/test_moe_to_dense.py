"""task=moe_to_dense end to end on a tiny model (few steps), and the paper's two initialisation baselines (their
weights, and their own pre-distillation perplexity)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir

from moe_lab.compress.calibration import calibrate
from moe_lab.compress.dense import export_compressed, to_dense
from moe_lab.models import load_model
from moe_lab.runs.compress import eval_ids
from moe_lab.tasks.moe_to_dense import baseline_student, ffn_names, kl_curves, plot_kl, reinitialise
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
    assert not (run / "metrics.csv").exists() and not (run / "hparams.yaml").exists()  # loggers follow the stage
    assert "grad_norm/total" in columns  # the default callbacks run on the dense student (MoE ones do nothing)
    assert not [c for c in columns if c.startswith(("load/", "drift/"))]
    assert summary["pre_distill"]["student"] == "converted"
    # the distill stage's config.yaml lets task=evaluate load the dense export (the run's method: kd)
    from moe_lab.runs.evaluate import load_for_eval
    from tests.eval.test_evaluate_task import eval_cfg

    model, _, labels = load_for_eval(eval_cfg(tmp_path / "eval", f"task.checkpoint={run / 'distill' / 'export'}"))
    assert labels == ("tiny_qwen3_moe_dense", "kd") and model.config.model_type == "qwen3"

    # task.resume=<run dir>: the finished stages are reused (their files untouched), the stage without its
    # done-marker (as a kill during distillation leaves it) continues from its last.ckpt
    from moe_lab.runs.stage import STAGE_DONE

    assert all((run / stage / STAGE_DONE).is_file() for stage in ("calibrate", "convert", "distill"))
    (run / "distill" / STAGE_DONE).unlink()
    kept = {f: f.stat().st_mtime_ns for f in (run / "calibrate" / "calibration.safetensors",
                                              run / "convert" / "export" / "model.safetensors")}
    resumed = run_task(_cfg(tmp_path, "method=kd", f"task.resume={run}", "task.trainer.max_steps=3"))
    assert {f: f.stat().st_mtime_ns for f in kept} == kept
    assert resumed["distill"]["global_step"] == 3 and resumed["pre_distill"] == summary["pre_distill"]
    assert (run / "distill" / STAGE_DONE).is_file()
    assert json.loads((run / "distill" / "summary.json").read_text())["resumed_from_step"] == 2


@pytest.mark.slow  # ~40 s: the whole pipeline with the hidden-state term
def test_fkl_hidden_records_its_normalisation_and_weight(tmp_path):
    """summary.json records fkl_hidden's normalisation and its effective weight; balanced: the weight of the
    last micro-batch = hidden_weight x its KD term / its layer-mean MSE (token means of the same batch)."""
    from moe_lab.tasks import run_task

    summary = run_task(_cfg(tmp_path, "method=kd", "method.options.loss=fkl_hidden",
                            "method.options.hidden_weight=0.5"))["distill"]
    assert summary["hidden_norm"] == "balanced" and summary["hidden_weight"] == 0.5
    assert summary["kd/hidden_weight"] == pytest.approx(0.5 * summary["kd/kl"] / summary["kd/hidden_mse"], rel=1e-4)


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
            {"pretrained": str(tmp_path / "student"), "tokenizer": "byte"}, dense=True)[0]
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


def _hand_ppl(model, ids, window: int) -> float:
    """Disjoint windows of ``window`` tokens, each token after a window's first scored: HF's own loss per window
    (mean CE of its ``n - 1`` shifted predictions), weighted by ``n - 1``."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin in range(0, len(ids), window):
            chunk = torch.tensor([ids[begin:begin + window]])
            if chunk.shape[1] > 1:
                nll += model(chunk, labels=chunk).loss.item() * (chunk.shape[1] - 1)
                count += chunk.shape[1] - 1
    return math.exp(nll / count)


def test_baseline_pre_distill_ppl_is_the_reinitialised_students(tmp_path):
    """The baselines' pre_distill.ppl is the re-initialised student's (the distillation's starting point), not
    the converted student's. Oracle: a hand-windowed perplexity of the baseline's export loaded by vanilla HF."""
    cfg = _cfg(tmp_path, "method=kd", "compress.init=random_ffn")
    teacher, tokenizer = load_model(cfg.model)
    cal = calibrate(teacher.eval(), [random_batch(batch=2, seq=16, pad_rows=())])
    converted = export_compressed(to_dense(teacher, cal, K=4), tmp_path / "convert" / "export", tokenizer)
    ids = eval_ids(cfg.compress.eval, tokenizer)
    assert len(ids) > 200  # several 32-token windows
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(converted).eval()
    converted_ppl = _hand_ppl(vanilla, ids, 32)
    for init in ("random_ffn", "random"):
        cfg.compress.init = init
        path, point = baseline_student(cfg, converted, tmp_path / "convert" / f"export_{init}")
        assert path == tmp_path / "convert" / f"export_{init}" and point["status"] == "ok"
        assert json.loads((path / "compress_manifest.json").read_text())["init"] == init
        baseline = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        # per window: fp32 sums of <= 31 log-probs ~ log(384) on each side, then exp: ~ 2 * 31 * 1.2e-7 * 6
        # relative on the mean nll; 1e-5 leaves a 2x margin
        assert point["ppl"] == pytest.approx(_hand_ppl(baseline, ids, 32), rel=1e-5)
        # not the converted student's (both near-uniform, ppl ~ vocab 384, yet 100x the tolerance apart)
        assert abs(point["ppl"] / converted_ppl - 1) > 1e-3


def test_kl_plot_draws_raw_steps_and_a_rolling_mean(tmp_path):
    """Oracle: the mean of the last <= 10 logged values, by an explicit loop; val/kd/kl rows as written."""
    import matplotlib.image

    gen = torch.Generator().manual_seed(0)
    kl = (0.3 - 0.0005 * torch.arange(25) + 0.05 * torch.rand(25, generator=gen)).tolist()
    lines = ["epoch,kd/kl,step,val/kd/kl", ",,0,"]  # Lightning's rows: a metric is blank where not logged
    lines += [f"0,{v!r},{i},," for i, v in enumerate(kl)]
    lines += ["0,,11,0.25", "0,,23,0.2"]
    csv = tmp_path / "metrics.csv"
    csv.write_text("\n".join(lines) + "\n")
    curves = kl_curves(csv)
    assert list(curves) == ["kd/kl", "kd/kl, rolling mean of 10 steps", "val/kd/kl"]
    assert curves["kd/kl"] == (list(range(25)), kl)
    steps, mean = curves["kd/kl, rolling mean of 10 steps"]
    assert steps == list(range(25))
    assert mean == pytest.approx([sum(kl[max(0, i - 9):i + 1]) / len(kl[max(0, i - 9):i + 1]) for i in range(25)],
                                 rel=1e-12)
    assert curves["val/kd/kl"] == ([11, 23], [0.25, 0.2])
    image = matplotlib.image.imread(plot_kl(csv, tmp_path / "plots" / "kd_kl.png"))
    assert image.shape[:2] == (400, 700) and image[..., :3].min() < 0.5  # 7 x 4 in at 100 dpi, something drawn
    (tmp_path / "empty.csv").write_text("epoch,step,train/loss\n0,0,1.0\n")
    with pytest.raises(ValueError, match="no kd/kl or val/kd/kl values"):
        plot_kl(tmp_path / "empty.csv", tmp_path / "x.png")


def test_kprime_preset_runs_both_readings_of_the_widened_teacher():
    """Table 4's preset: k' = 16, 32, 64, 96 under both the paper's Eq. 6 and the family rule, on the DO-ACP K = 8
    student of the base Qwen3 preset."""
    from moe_lab.distill.teacher import weight_rule_name

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=moe_to_dense/qwen3_30b_a3b_kprime"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert [int(k) for k in params["method.options.teacher_top_k"].split(",")] == [16, 32, 64, 96]
    rules = params["method.options.teacher_weight_rule"].split(",")
    assert sorted(weight_rule_name(r) for r in rules) == ["family", "paper_eq6"]
    assert (cfg.compress.score, cfg.compress.grouping, cfg.compress.K) == ("do_acp", "rr", 8)
    assert cfg.task.name == "moe_to_dense" and cfg.method.name == "kd"


def test_gpt_oss_preset_chooses_its_scaling_by_pre_distill_perplexity():
    """Sec. 4.6: GPT-OSS renormalises, "so we sweep uniform and proportional"; Stage 2 keeps the lower
    pre-distillation perplexity (compress.scaling=best_ppl, tested in tests/compress/test_sweep.py)."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=moe_to_dense/gpt_oss_20b"])
    assert cfg.compress.scaling == "best_ppl"
    assert list(cfg.compress.scaling_candidates) == ["uniform", "proportional"]
