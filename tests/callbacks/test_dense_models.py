"""Dense causal LMs (a to_dense export) through models.load_model and a method=kd run with every callback.

Oracles: vanilla HF ``AutoModelForCausalLM`` (from_pretrained / seeded from_config) logits, bit-exact; the method
names of conf/method/*.yaml for the refusals; for the callbacks, the same Hydra-composed run with an MoE student
(the teacher itself), which does write the routing metrics and files the dense run must not.
"""

from __future__ import annotations

import csv
import logging
import types

import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir

from moe_lab.compress.calibration import calibrate
from moe_lab.compress.dense import export_compressed, to_dense
from moe_lab.core.method_class import module_fact
from moe_lab.models import load_model
from tests.conftest import ROOT, random_batch, tiny_model_cfg, word_text

MOE_CALLBACKS = ("ExpertLoadCallback", "RouterBiasCallback", "RoutingDriftCallback", "RoutingLogCallback")
DENSE_QWEN3 = {"vocab_size": 384, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
               "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(teacher dir, dense student dir, in-memory student): a tiny Qwen3-MoE and its to_dense K=4 export."""
    root = tmp_path_factory.mktemp("dense")
    teacher, tokenizer = load_model(tiny_model_cfg("qwen3_moe"))
    teacher.eval()
    student = to_dense(teacher, calibrate(teacher, [random_batch(batch=2, seq=16, pad_rows=())]), K=4)
    export_compressed(student, root / "student", tokenizer)
    teacher.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    return root / "teacher", root / "student", student.eval()


def _ids(vocab: int = 384) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_pretrained_dense_export_round_trip(exports):
    _, student_dir, student = exports
    model, tokenizer = load_model({"pretrained": str(student_dir)}, method="kd", dense=True)
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(student_dir).eval()
    assert model.config.model_type == "qwen3" and len(tokenizer) == 259
    got = model.eval()(input_ids=_ids()).logits
    assert torch.equal(got, vanilla(input_ids=_ids()).logits)
    assert torch.equal(got, student(input_ids=_ids()).logits)  # the export is the converted student


@torch.no_grad()
def test_config_class_dense_model_equals_seeded_from_config():
    model, _ = load_model({"config_class": "Qwen3Config", "config": DENSE_QWEN3, "seed": 3}, method="kd", dense=True)
    torch.manual_seed(3)
    vanilla = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**DENSE_QWEN3)).eval()
    assert type(model) is type(vanilla)
    assert torch.equal(model.eval()(input_ids=_ids()).logits, vanilla(input_ids=_ids()).logits)


def test_moe_methods_refuse_dense_models(exports):
    _, student_dir, _ = exports
    names = sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dense = [n for n in names
                 if module_fact(compose("config", [f"method={n}"]).method, "trains_dense_models")]
    moe_methods = [n for n in names if n not in dense]
    assert dense == ["kd"] and "sft" in moe_methods and "condenser" in moe_methods
    for method in moe_methods:
        with pytest.raises(ValueError, match=rf"method={method} trains MoE models, but model.pretrained=\S+ is a "
                                             r"dense 'qwen3' model .*a dense model trains only under a method whose "
                                             r"LightningModule sets trains_dense_models \(distillation, e.g. method=kd\)"):
            load_model({"pretrained": str(student_dir)}, method=method)
    with pytest.raises(ValueError, match=r"method=esft_token trains MoE models, but model.config_class=Qwen3Config"):
        load_model({"config_class": "Qwen3Config", "config": DENSE_QWEN3}, method="esft_token")
    with pytest.raises(ValueError, match=r"unsupported model_type 'qwen3': moe-lab supports .*olmoe.*method=kd"):
        load_model({"pretrained": str(student_dir)})  # a caller that does not allow dense models


def _compose(tmp_path, name, *overrides):
    train = word_text(tmp_path / "train.txt", 8, words_per_line=12)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[
            "model=tiny_qwen3_moe", "dataset=text", f"dataset.path={train}", "dataset.block_size=16",
            "dataset.batch_size=2", "dataset.num_blocks=4", "dataset.streaming=false", "task.trainer.max_steps=2",
            "task.scheduler.warmup_steps=0", "task.export=false", "logger=csv", "callbacks=routing_log",
            "callbacks.expert_load.log_every_n_steps=1", "callbacks.expert_load.heatmap_every_n_steps=1",
            "callbacks.router_bias.log_every_n_steps=1", "callbacks.routing_drift.every_n_steps=1",
            f"paths.output_dir={tmp_path / name}", *overrides])


def _columns(run) -> set[str]:
    with open(run / "metrics.csv") as f:
        return set(next(csv.reader(f)))


def test_finetune_refuses_a_dense_model_for_an_moe_method(exports, tmp_path):
    from moe_lab.tasks import run_task

    _, student_dir, _ = exports
    with pytest.raises(ValueError, match=r"model.pretrained=\S+ holds a Qwen3Config .*model.config_class="
                                         r"Qwen3MoeConfig.*add model.config_class=null model.config=null"):
        run_task(_compose(tmp_path, "mismatch", "method=kd", f"model.pretrained={student_dir}"))
    with pytest.raises(ValueError, match="method=sft trains MoE models.*dense 'qwen3'.*method=kd"):
        run_task(_compose(tmp_path, "sft", "method=sft", f"model.pretrained={student_dir}",
                          "model.config_class=null", "model.config=null"))


def test_kd_fit_with_dense_student_and_every_callback(exports, tmp_path, caplog):
    """A real Lightning fit (Hydra-composed defaults + routing_log): each MoE callback logs its one line and writes
    nothing; the same config with an MoE student writes load/ and drift/ metrics and routing_log.jsonl."""
    from moe_lab.tasks import run_task

    teacher_dir, student_dir, _ = exports
    caplog.set_level(logging.INFO, logger="moe_lab.callbacks")
    dense = run_task(_compose(tmp_path, "dense", "method=kd", f"model.pretrained={student_dir}",
                              "model.config_class=null", "model.config=null", f"method.teacher={teacher_dir}"))
    assert dense["global_step"] == 2 and dense["kd/kl"] > 0
    for callback in MOE_CALLBACKS:
        lines = [r for r in caplog.records if r.getMessage() == f"no MoE layers in qwen3: {callback} does nothing"]
        assert len(lines) == 1, callback
    run = tmp_path / "dense"
    columns = _columns(run)
    assert {"kd/kl", "grad_norm/total", "grad_norm/attention"} <= columns  # grad_norm works on a dense model
    assert not [c for c in columns if c.startswith(("load/", "router_bias/", "drift/"))]
    assert not (run / "routing_log.jsonl").exists() and not list((run / "plots").glob("expert_load*"))
    assert not list((run / "plots").glob("router_bias*"))

    caplog.clear()
    moe = _compose(tmp_path, "moe", "method=kd", f"method.teacher={teacher_dir}")  # control: an MoE student
    run_task(moe)
    assert not [r for r in caplog.records if "no MoE layers" in r.getMessage()]
    columns = _columns(tmp_path / "moe")
    assert {"load/gini_mean", "drift/kl_mean"} <= columns
    assert (tmp_path / "moe" / "routing_log.jsonl").is_file()


def test_wandb_media_uploads_a_dense_export_and_skips_a_patch_without_export_hooks(caplog):
    from lightning.pytorch.loggers import WandbLogger

    from moe_lab.callbacks.wandb_media import WandbMediaCallback
    from moe_lab.methods.distill import _DensePatch

    trainer = types.SimpleNamespace(loggers=[WandbLogger(offline=True)], is_global_zero=True)
    dense = types.SimpleNamespace(patch=_DensePatch(torch.nn.Linear(1, 1)))
    caplog.set_level(logging.INFO, logger="moe_lab.callbacks")
    WandbMediaCallback(log_export=True).on_fit_start(trainer, dense)
    assert len(dense.patch.export_hooks) == 1 and not caplog.records  # the dense export is uploaded too
    bare = types.SimpleNamespace(patch=types.SimpleNamespace())
    WandbMediaCallback(log_export=True).on_fit_start(trainer, bare)
    assert [r.getMessage() for r in caplog.records] == [
        "SimpleNamespace has no export hooks: WandbMediaCallback cannot upload the export"]
