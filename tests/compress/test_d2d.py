"""D2D pruning (the MoE -> dense paper's dense-to-dense baseline, App. M): the pruned vanilla model equals the
teacher with the pruned units zeroed and the pruned layers removed (RMSNorm rescaled to the kept width), the
(batch L2, sequence mean) aggregation by hand, the depth score against a model with the layer removed, and the
parameter counts of Table 13's candidates from Qwen3-32B's public config."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from torch import nn

from moe_lab.compress.d2d import (
    D2DTarget,
    activation_importance,
    aggregate,
    best_candidate,
    count_parameters,
    keep_plan,
    layer_importance,
    lm_loss,
    prune_candidates,
    prune_dense,
)
from tests.conftest import random_batch

TINY = {"vocab_size": 384, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-12}
TARGET = D2DTarget(num_hidden_layers=2, hidden_size=24, intermediate_size=32, num_attention_heads=2,
                   num_key_value_heads=1)


def _teacher(seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**TINY)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else 0.2 * torch.randn(p.shape, generator=gen))
    return model


def _batches():
    return [{k: random_batch(seed=s)[k] for k in ("input_ids", "attention_mask")} for s in range(2)]


def _without_layers(model, keep):
    out = copy.deepcopy(model)
    out.model.layers = nn.ModuleList([out.model.layers[i] for i in keep])
    out.config.num_hidden_layers = len(keep)
    out.config.layer_types = [out.config.layer_types[i] for i in keep]
    return out


def test_aggregation_by_hand():
    v = torch.tensor([[[1.0, 2.0], [3.0, 0.0], [9.0, 9.0]], [[2.0, 4.0], [0.0, 0.0], [5.0, 1.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    # sequence means: [2, 1] and [7/3, 5/3]; L2 over the two sequences
    want = torch.tensor([math.sqrt(4 + 49 / 9), math.sqrt(1 + 25 / 9)], dtype=torch.float64)
    assert torch.allclose(aggregate(v, mask), want, rtol=1e-6)  # fp32 sequence means


def test_pruned_model_equals_the_zeroed_teacher():
    teacher = _teacher()
    batches = _batches()
    importance = activation_importance(teacher, batches)
    plan = keep_plan(teacher.config, importance, layer_importance(teacher, batches), TARGET)
    student = prune_dense(teacher, plan, TARGET)
    assert type(student) is type(teacher) and student.config.hidden_size == 24
    assert len(plan["layers"]) == 2 and all(len(plan["q_heads"][i]) == 2 for i in plan["layers"])

    ref = _without_layers(teacher, plan["layers"])
    H, d = TINY["hidden_size"], TINY["head_dim"]
    drop = torch.tensor(sorted(set(range(H)) - set(plan["channels"])))
    with torch.no_grad():
        ref.model.embed_tokens.weight[:, drop] = 0
        ref.lm_head.weight[:, drop] = 0
        scale = math.sqrt(TARGET.hidden_size / H)  # RMS over the kept channels only
        ref.model.norm.weight.mul_(scale)
        for new, old in enumerate(plan["layers"]):
            layer = ref.model.layers[new]
            layer.input_layernorm.weight.mul_(scale)
            layer.post_attention_layernorm.weight.mul_(scale)
            layer.self_attn.o_proj.weight[drop] = 0
            layer.mlp.down_proj.weight[drop] = 0
            gone = sorted(set(range(TINY["intermediate_size"])) - set(plan["neurons"][old]))
            layer.mlp.down_proj.weight[:, gone] = 0
            for h in set(range(TINY["num_attention_heads"])) - set(plan["q_heads"][old]):
                layer.self_attn.o_proj.weight[:, h * d:(h + 1) * d] = 0
        for batch in batches:
            got = student(**batch, use_cache=False).logits
            want = ref(**batch, use_cache=False).logits
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # full-size target: the teacher itself
    full = D2DTarget.of(teacher.config)
    same = prune_dense(teacher, keep_plan(teacher.config, importance, None, full), full)
    assert torch.equal(same(**batches[0]).logits, teacher(**batches[0]).logits)


def test_layer_importance_is_the_loss_rise_without_that_layer():
    teacher, batches = _teacher(), _batches()
    scores = layer_importance(teacher, batches)
    base = lm_loss(teacher, batches)
    for i in range(TINY["num_hidden_layers"]):
        keep = [j for j in range(TINY["num_hidden_layers"]) if j != i]
        assert float(scores[i]) == pytest.approx(lm_loss(_without_layers(teacher, keep), batches) - base, abs=1e-5)


def test_search_keeps_the_lowest_perplexity_and_bad_targets_are_refused():
    teacher, batches = _teacher(), _batches()
    targets = {"width": D2DTarget(3, 24, 32, 2, 1), "depth": D2DTarget(2, 32, 48, 4, 2)}
    rows, plans = prune_candidates(teacher, batches, targets, lambda m: {"ppl": math.exp(lm_loss(m, batches)),
                                                                         "status": "ok"})
    assert len(plans["depth"]["layers"]) == 2 and len(plans["width"]["channels"]) == 24
    assert [r["candidate"] for r in rows] == ["width", "depth"]
    assert best_candidate(rows)["ppl"] == min(r["ppl"] for r in rows)
    with pytest.raises(ValueError, match="num_attention_heads=3 must be a multiple of num_key_value_heads=2"):
        keep_plan(teacher.config, activation_importance(teacher, batches), None, D2DTarget(3, 24, 32, 3, 2))
    with pytest.raises(ValueError, match="hidden_size=40 must be between 1 and the teacher's 32"):
        keep_plan(teacher.config, activation_importance(teacher, batches), None, D2DTarget(3, 40, 32, 2, 1))
    with pytest.raises(ValueError, match="no candidate has a finite perplexity"):
        best_candidate([{"ppl": math.nan, "status": "nan"}])


QWEN3_32B = {"vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
             "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}


@pytest.mark.parametrize("target, paper", [
    (D2DTarget(64, 2048, 6144, 8, 4), 3.44),    # width-only, the chosen candidate
    (D2DTarget(64, 1536, 8192, 12, 4), 3.29),   # width-only
    (D2DTarget(56, 2048, 6144, 16, 8), 3.44),   # combined
    (D2DTarget(40, 2048, 6144, 16, 4), 2.55),   # combined
])
def test_table_13_parameter_counts(target, paper):
    """The paper states the query heads; the KV heads that reproduce its parameter counts are 4 / 4 / 8 / 4."""
    assert round(count_parameters(transformers.Qwen3Config(**QWEN3_32B), target) / 1e9, 2) == paper


def test_task_d2d_prune_exports_the_lowest_perplexity_candidate(tmp_path):
    from hydra import compose, initialize_config_dir

    from moe_lab.data.tokenizer import load_tokenizer
    from moe_lab.tasks import run_task
    from tests.conftest import ROOT, word_text

    _teacher().save_pretrained(tmp_path / "teacher")
    load_tokenizer("byte").save_pretrained(tmp_path / "teacher")
    train, test = word_text(tmp_path / "train.txt", 40, seed=0, vocab=9), word_text(tmp_path / "test.txt", 4, seed=1,
                                                                                     vocab=9)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "task=d2d_prune", "model=tiny_qwen3_moe", f"model.pretrained={tmp_path / 'teacher'}",
            "model.config_class=null", "model.config=null", "model.name=tiny_dense", f"paths.output_dir={tmp_path / 'run'}",
            "dataset=text", f"compress.calibration.dataset.path={train}", "compress.calibration.num_sequences=4",
            "compress.calibration.seq_len=16", f"compress.eval.path={test}", "compress.eval.max_length=32",
            "compress.eval.stride=32",
            ("+task.candidates.width={num_hidden_layers:3,hidden_size:24,intermediate_size:32,"
             "num_attention_heads:2,num_key_value_heads:1}"),
            ("+task.candidates.depth={num_hidden_layers:2,hidden_size:32,intermediate_size:48,"
             "num_attention_heads:4,num_key_value_heads:2}")])
    summary = run_task(cfg)
    rows = {r["candidate"]: r for r in summary["candidates"]}
    assert summary["chosen"] == min(rows, key=lambda n: rows[n]["ppl"])
    exported = transformers.AutoModelForCausalLM.from_pretrained(summary["export"])
    chosen = rows[summary["chosen"]]
    assert exported.config.hidden_size == chosen["hidden_size"] and exported.num_parameters() == chosen["params"]
    assert (tmp_path / "run" / "candidates.md").read_text().count("**") == 2


def test_preset_holds_table_13_candidates():
    from hydra import compose, initialize_config_dir

    from moe_lab.tasks.d2d_prune import _targets
    from tests.conftest import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=moe_to_dense/d2d_qwen3_32b"])
    targets = _targets(cfg.task)
    assert [(t.num_hidden_layers, t.hidden_size, t.intermediate_size, t.num_attention_heads) for t in targets.values()] \
        == [(64, 2048, 6144, 8), (64, 1536, 8192, 12), (56, 2048, 6144, 16), (48, 2048, 6144, 16), (40, 2048, 6144, 16)]
    assert cfg.compress.calibration.num_sequences == 1024 and cfg.model.name == "qwen3_32b"
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        empty = compose("config", overrides=["task=d2d_prune"])
    with pytest.raises(ValueError, match="task.candidates is empty"):
        _targets(empty.task)
