"""Exports of compressed, condensed and distilled models are written in the model's LOAD dtype (every tensor, apart
from the ones HF keeps in fp32: DeepSeek-V3's routing correction bias, and from transformers 5.24 its router weight),
and config.json says so.

Paths: task=compress (to_dense, prune: ``export_compressed``), task=condense (``to_vanilla`` + ``export_compressed``,
``export_condensed``), method=condense_sft (``_rewrite_export`` from the live model), method=kd with a dense student
(``_DensePatch`` through task=finetune), and a DeepSpeed ZeRO checkpoint of a dense KD run converted to an HF export.
Each directory is reloaded the documented way (vanilla ``from_pretrained``, ``load_condensed``). Oracles: the
stored dtypes against the rule written out here (bf16, fp32 for the names the transformers class declares in
``_keep_in_fp32_modules_strict``, int64 for condensed expert ids), and weights / logits
``torch.equal`` to an independently made reference: the same compression of the model as loaded (bf16), or the
in-memory trained model (fp32 master weights) cast to bf16 by the test."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from moe_lab.compress import calibrate, condense, export_condensed, load_condensed
from moe_lab.compress.condense import CONDENSE_FILE, to_vanilla
from moe_lab.compress.dense import export_compressed, to_dense
from moe_lab.compress.prune import prune_experts
from moe_lab.core.precision import apply_master_weights, export_in_load_dtype
from moe_lab.methods.condense_sft import CondenseSFTModule
from moe_lab.models import load_model
from tests.conftest import ROOT, build_tiny, hf_fp32_names, random_batch, tiny_model_cfg, word_text

BF16 = torch.bfloat16
KEPT_FP32 = "e_score_correction_bias"  # DeepSeek-V3's fp32 buffer (HF's _keep_in_fp32_modules_strict)


def load_bf16(family: str, seed: int = 0):
    """``conf/model/tiny_<family>`` loaded with model.dtype=bfloat16, its fp32 correction biases (DeepSeek-V3)
    set to random values that bf16 cannot hold, so that a rounding shows."""
    cfg = tiny_model_cfg(family)
    cfg.dtype = "bfloat16"
    model, tokenizer = load_model(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(KEPT_FP32):
                assert buf.dtype == torch.float32
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.2)
                assert not torch.equal(buf, buf.to(BF16).float())
    return model.eval(), tokenizer


def condense_layer_1(model):
    """Condense decoder layer 1 (an MoE layer in every tiny config) to its two most selected experts."""
    calibration = calibrate(model, [random_batch(3, 10)])
    experts = calibration.layers[1]["count"].topk(2).indices.tolist()
    return condense(model, calibration, [1], {1: experts})


def stored(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    assert out, f"no safetensors in {directory}"
    return out


def expected_dtype(key: str, model_type: str) -> torch.dtype:
    if key.endswith(hf_fp32_names(model_type)):
        return torch.float32
    if key.endswith(".mlp.gates"):  # CD-MoE's fixed gates: kept in fp32 by design (they are a scaling, not weights)
        return torch.float32
    return torch.int64 if key.endswith("expert_ids") else BF16


def assert_in_bf16(directory) -> dict[str, torch.Tensor]:
    """Every stored tensor bf16 but those HF keeps in fp32 (``hf_fp32_names``: DeepSeek-V3's correction bias, from
    transformers 5.24 its router weight) and the condensed layers' expert ids (int64); config.json says bfloat16."""
    state = stored(directory)
    config = json.loads((directory / "config.json").read_text())
    wrong = {k: v.dtype for k, v in state.items() if v.dtype != expected_dtype(k, config["model_type"])}
    assert not wrong, wrong
    assert config["dtype"] == "bfloat16"
    return state


def logits(model, seed: int = 9) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**random_batch(2, 8, seed=seed)).logits


def parameters_to_bf16(model):
    """``model`` with its parameters cast to bf16 but those HF keeps in fp32 (buffers, e.g. rotary frequencies, as
    they are)."""
    kept = hf_fp32_names(model.config.model_type)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(kept):
                p.data = p.data.to(BF16)
    return model


def assert_same_model(back, reference) -> None:
    ref = reference.state_dict()
    for key, value in back.state_dict().items():
        assert value.dtype == ref[key].dtype and torch.equal(value, ref[key]), key
    assert torch.equal(logits(back), logits(reference))


# task=compress -----------------------------------------------------------------------------------------------
def test_to_dense_of_an_upcast_bf16_model_exports_bf16(tmp_path):
    """A model loaded in bf16 and trained with fp32 master weights, then converted: the student and its export
    are bf16, equal to the conversion of the model as loaded (before: a float32 export)."""
    teacher, tokenizer = load_bf16("qwen3_moe")
    as_loaded = copy.deepcopy(teacher)
    apply_master_weights(teacher, "bf16-mixed")
    assert next(teacher.parameters()).dtype == torch.float32
    calibration = calibrate(as_loaded, [random_batch(3, 10)])
    export_compressed(to_dense(teacher, calibration), tmp_path, tokenizer)
    assert_in_bf16(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_model(back, to_dense(as_loaded, calibration))


def test_prune_keeps_the_fp32_correction_bias(tmp_path):
    """DeepSeek-V3 loaded in bf16 (its correction bias fp32, as HF keeps it): the pruned export is bf16 but for the
    bias, which keeps the source's fp32 values of the kept experts (before: rounded to bf16)."""
    model, tokenizer = load_bf16("deepseek_v3")
    source = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(KEPT_FP32)}
    pruned = prune_experts(model, calibrate(model, [random_batch(3, 10)]), keep=4, top_k=2, group_balanced=True)
    export_compressed(pruned, tmp_path, tokenizer)
    state = assert_in_bf16(tmp_path)
    kept = pruned.moe_lab_manifest["layers"]
    for key, bias in source.items():
        layer = key.split(".")[2]
        assert torch.equal(state[key], bias[torch.tensor(kept[layer])]), key
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_model(back, pruned)


def test_prune_of_an_upcast_bf16_model_is_bf16(tmp_path):
    """Pruning a bf16-loaded model trained with fp32 master weights: the pruned model is built in the load dtype
    and equals the pruning of the model as loaded (before: an fp32 pruned model)."""
    model, tokenizer = load_bf16("olmoe")
    as_loaded = copy.deepcopy(model)
    calibration = calibrate(as_loaded, [random_batch(3, 10)])
    apply_master_weights(model, "bf16-mixed")
    pruned = prune_experts(model, calibration, keep=4, top_k=2)
    assert next(pruned.parameters()).dtype == BF16
    export_compressed(pruned, tmp_path, tokenizer)
    assert_in_bf16(tmp_path)
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path),
                      prune_experts(as_loaded, calibration, keep=4, top_k=2))


# task=condense -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["deepseek_v3", "olmoe"])
def test_condensed_export_in_the_load_dtype(tmp_path, family):
    """export_condensed + load_condensed of a bf16 model: bf16 tensors, the fp32 correction bias of the routed layer
    kept (before: rounded to bf16 by load_condensed), config.json and the manifest say bfloat16 (before: a model
    moved to bf16 with .to() wrote no config dtype)."""
    if family == "olmoe":  # a float32 model moved to bf16 (config.dtype unset)
        model, tokenizer = build_tiny(family).eval(), None
        rotary = {n: b for n, b in model.named_buffers() if "inv_freq" in n}
        model.to(BF16)
        for name, buf in rotary.items():  # as from_pretrained(dtype=bf16) has them (not persistent: not exported)
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = buf
    else:
        model, tokenizer = load_bf16(family)
    condense_layer_1(model)
    export_condensed(model, tmp_path, tokenizer)
    assert_in_bf16(tmp_path)
    assert json.loads((tmp_path / CONDENSE_FILE).read_text())["dtype"] == "bfloat16"
    assert_same_model(load_condensed(tmp_path), model)


def test_condense_task_export_of_a_bf16_checkpoint(tmp_path):
    """task=calibrate + task=condense on a bf16 DeepSeek-V3 checkpoint (non-zero fp32 correction bias, as real
    ones have): the condensed export is bf16 with the routed layer's fp32 bias, and load_condensed gives the model
    the test condenses itself from the checkpoint, the calibration file and the summary's choices (before: the bias
    came back rounded to bf16)."""
    from moe_lab.compress import Calibration
    from moe_lab.tasks import run_task

    model, tokenizer = load_bf16("deepseek_v3")
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    text = word_text(tmp_path / "c4.txt", 30)
    data = ["num_sequences=4", "seq_len=16", "batch_size=2", "sample=first"]
    model_cfg = ["model=tiny_deepseek_v3", f"model.pretrained={tmp_path / 'ckpt'}", "model.config_class=null",
                 "model.config=null", "model.dtype=bfloat16"]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cal = run_task(compose("config", overrides=[
            f"paths.output_dir={tmp_path / 'cal'}", "task=calibrate", *model_cfg,
            "dataset@compress.calibration.dataset=c4", f"compress.calibration.dataset.path={text}",
            *[f"compress.calibration.{d}" for d in data]]))
        cfg = compose("config", overrides=[
            f"paths.output_dir={tmp_path / 'cd'}", "task=condense", *model_cfg,
            f"condense.calibration_file={cal['calibration']}", f"condense.search.dataset.path={text}",
            "condense.routed_experts=2", "condense.layers=[1]", *[f"condense.search.{d}" for d in data]])
    summary = run_task(cfg)
    assert summary["export_format"] == "condensed"
    export = tmp_path / "cd" / "export"
    state = assert_in_bf16(export)
    reference, _ = load_model(cfg.model)
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert torch.equal(state[bias], reference.get_buffer(bias))
    condense(reference.eval(), Calibration.load(cal["calibration"]), [1], {1: summary["experts"]["1"]})
    assert_same_model(load_condensed(export), reference)


def test_vanilla_condensed_export_of_an_upcast_model_is_bf16(tmp_path):
    """to_vanilla of a bf16-loaded Qwen3-MoE condensed in fp32 (model.float()): written in bf16, equal to the fp32
    vanilla model cast to bf16 (before: a float32 export)."""
    model, tokenizer = load_bf16("qwen3_moe")
    condense_layer_1(model)
    model.float()
    fp32_reference = copy.deepcopy(model)
    fp32_reference.config.dtype = "float32"  # the same model, loaded in fp32
    reference = to_vanilla(fp32_reference)
    assert reference.dtype == torch.float32
    export_compressed(to_vanilla(model), tmp_path, tokenizer)
    assert_in_bf16(tmp_path)
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path), parameters_to_bf16(reference))


# method=condense_sft -------------------------------------------------------------------------------------------
def test_condense_sft_export_from_the_live_model_is_bf16(tmp_path):
    """condense_sft on a bf16 DeepSeek-V3, one step under bf16-mixed (fp32 master weights on the condensed experts):
    the condensed export (written from the live model) is bf16 with the fp32 bias, and reloads equal to the trained
    model with its parameters cast to bf16 by the test (before: fp32 experts in the file; the bias rounded)."""
    source, _ = load_bf16("deepseek_v3")
    condense_layer_1(source)
    export_condensed(source, tmp_path / "cd")
    module = CondenseSFTModule(load_bf16("deepseek_v3", seed=5)[0], options={"condensed": str(tmp_path / "cd")},
                               optim={"lr": 1e-2})
    trainer = L.Trainer(max_steps=1, accelerator="cpu", precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([random_batch(2, 8)], batch_size=None))
    kept = hf_fp32_names("deepseek_v3")
    trained = {n for n, p in module.model.named_parameters() if p.dtype == torch.float32 and not n.endswith(kept)}
    assert trained and trained == set(module.trainable_names)  # fp32 master weights, updated
    export_in_load_dtype(module.patch)  # as task=finetune
    module.patch.export(tmp_path / "sft")
    state = assert_in_bf16(tmp_path / "sft")
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert torch.equal(state[bias], source.get_buffer(bias))
    assert_same_model(load_condensed(tmp_path / "sft"), parameters_to_bf16(copy.deepcopy(module.model)))


# method=kd, dense student --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense_student(tmp_path_factory):
    """A to_dense student of a bf16 tiny_qwen3_moe, exported (bf16)."""
    path = tmp_path_factory.mktemp("student")
    teacher, tokenizer = load_bf16("qwen3_moe")
    export_compressed(to_dense(teacher, calibrate(teacher, [random_batch(3, 10)])), path, tokenizer)
    return path


def _kd_cfg(student, out, *overrides):
    train = word_text(out.parent / "train.txt", 20)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "method=kd", "model=tiny_qwen3_moe", f"model.pretrained={student}", "model.config_class=null",
            "model.config=null", "model.dtype=bfloat16", "model.name=tiny_dense", "dataset=text",
            f"dataset.path={train}", "dataset.block_size=16", "dataset.batch_size=2", "dataset.streaming=false",
            "logger=none", "callbacks=none", f"paths.output_dir={out}", *overrides])
    teacher = tiny_model_cfg("qwen3_moe")
    teacher.dtype = "bfloat16"
    cfg.method.teacher = teacher
    return cfg


def test_kd_dense_student_export_through_finetune_is_bf16(dense_student, tmp_path):
    """task=finetune, method=kd, a bf16 dense student on hardware=cpu (32-true: every parameter trains as an fp32
    master): the export is bf16 and equals last.ckpt's fp32 weights cast to bf16 by the test."""
    from moe_lab.runs.training import finetune

    out = tmp_path / "run"
    finetune(_kd_cfg(dense_student, out, "task.trainer.max_steps=1", "task.trainer.limit_val_batches=0",
                     "task.scheduler.warmup_steps=0"))
    assert_in_bf16(out / "export")
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert ckpt and all(v.dtype == torch.float32 for v in ckpt.values() if v.is_floating_point())
    back = AutoModelForCausalLM.from_pretrained(out / "export")
    reference = AutoModelForCausalLM.from_pretrained(dense_student)
    reference.load_state_dict({k.removeprefix("model."): v.to(BF16) for k, v in ckpt.items()})
    assert not torch.equal(logits(reference), logits(AutoModelForCausalLM.from_pretrained(dense_student)))  # trained
    assert_same_model(back, reference)


# a DeepSpeed ZeRO checkpoint of a dense KD run ----------------------------------------------------------------
_WRITE_ZERO = '''
import os, sys
import torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from hydra.utils import instantiate
from omegaconf import OmegaConf
from moe_lab.models import load_model

run = sys.argv[1]
cfg = OmegaConf.load(f"{run}/config.yaml")
deepspeed.init_distributed(dist_backend="gloo")
model, _ = load_model(cfg.model, method=cfg.method.name, dense=True)  # the dense KD student
module = instantiate(cfg.method, model=model, optim=cfg.task.optim, scheduler=cfg.task.scheduler, _recursive_=False)
opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config={"train_micro_batch_size_per_gpu": 1,
    "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True})
ids = torch.arange(3, 19).view(2, 8)
engine.backward(engine(input_ids=ids, labels=ids).loss.float())
engine.step()
engine.save_checkpoint(f"{run}/checkpoints/last.ckpt", tag="checkpoint", client_state={"global_step": 1})
torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, f"{run}/oracle.pt")
'''


@pytest.mark.slow
def test_zero_checkpoint_of_a_dense_kd_run_converts(dense_student, tmp_path):
    """DeepSpeed's own engine (CPU, one rank, bf16, ZeRO-2) trains the dense KD student of a run's config.yaml one
    step and saves a ZeRO checkpoint; convert loads the model for the run's method (before: refused as a dense model)
    and writes a bf16 export equal to the engine's bf16 weights (the oracle, saved by the engine's process), with
    the run's teacher and teacher record deleted since (KDModule(export_only=True): neither is loaded)."""
    from moe_lab.runtime.checkpoint_io import convert_zero_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(_kd_cfg(dense_student, run), run / "config.yaml")
    (tmp_path / "write_zero.py").write_text(_WRITE_ZERO)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(tmp_path / "write_zero.py"), str(run), "29587"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    oracle = torch.load(run / "oracle.pt", weights_only=True)
    cfg = OmegaConf.load(run / "config.yaml")  # teacher and teacher record gone since: conversion needs neither
    cfg.method.teacher, cfg.method.options.teacher_logits = str(tmp_path / "gone"), str(tmp_path / "gone.st")
    OmegaConf.save(cfg, run / "config.yaml")
    convert_zero_checkpoint(run / "checkpoints" / "last.ckpt", tmp_path / "export")
    assert_in_bf16(tmp_path / "export")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert back.keys() == {k.removeprefix("model.") for k in oracle}
    assert all(v.dtype == oracle[f"model.{k}"].dtype and torch.equal(v, oracle[f"model.{k}"]) for k, v in back.items())
    before = AutoModelForCausalLM.from_pretrained(dense_student).state_dict()
    assert not all(torch.equal(v, before[k]) for k, v in back.items())  # the step changed the weights
