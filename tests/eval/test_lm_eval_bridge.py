"""lm-eval bridge: runs offline on an exported tiny checkpoint and on a model in memory, and agrees with
moe-lab's own scoring (continuation log-likelihoods, batched generation) item by item."""

from __future__ import annotations

import pytest
import torch
import transformers

import moe_lab
from moe_lab.data.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer
from moe_lab.eval.generation import generate
from moe_lab.eval.likelihood import score_choices
from moe_lab.eval.lm_eval_bridge import evaluate_with_lm_eval, lm_eval_metrics, lm_eval_model, local_tasks
from moe_lab.eval.lm_eval_tasks.llm_adapters import load_choice_docs, load_generation_docs
from moe_lab.moe.block import MoEBlock
from tests.conftest import DATA_DIR, build_tiny, random_batch

LIMIT = 5
MC_TASKS = {"llm_adapters_boolq": "boolq", "llm_adapters_social_iqa": "siqa",
            "llm_adapters_winogrande": "winogrande"}


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def model():
    # vocab = the byte tokenizer's, so lm-eval's HF generate cannot pick ids that decode to nothing; 2048
    # positions, so lm-eval does not left-truncate the longer GSM8K prompts (it keeps max_length - max_gen_toks)
    return build_tiny("olmoe", vocab_size=BYTE_VOCAB_SIZE, max_position_embeddings=2048).eval()


def test_local_tasks_cover_the_llm_adapters_files():
    assert local_tasks() == sorted([
        "llm_adapters_" + name for name in (
            "boolq", "piqa", "social_iqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa",
            "gsm8k", "svamp", "multiarith", "addsub", "aqua", "singleeq", "mawps")
    ])


def test_exported_checkpoint_matches_moe_lab_scoring(model, tok, tmp_path):
    moe_lab.apply(model).export(tmp_path / "export", tok)
    result = evaluate_with_lm_eval(tmp_path / "export", None, [*MC_TASKS, "llm_adapters_gsm8k"], limit=LIMIT,
                                   batch_size=4, data_dir=DATA_DIR, log_samples=True, gen_kwargs={"max_gen_toks": 16})
    metrics = lm_eval_metrics(result)
    assert set(metrics) == {*MC_TASKS, "llm_adapters_gsm8k"}
    for task, eval_set in MC_TASKS.items():
        docs = load_choice_docs(eval_set, DATA_DIR)["test"].select(range(LIMIT))
        ours = score_choices(model, tok, docs["context"], docs["choices"])
        gold = docs["gold"]
        assert metrics[task]["acc"] == pytest.approx(sum(o["pred"] == g for o, g in zip(ours, gold)) / LIMIT)
        assert metrics[task]["acc_norm"] == pytest.approx(
            sum(o["pred_norm"] == g for o, g in zip(ours, gold)) / LIMIT)
        for sample, o in zip(sorted(result["samples"][task], key=lambda s: s["doc_id"]), ours):
            assert [r[0][0] for r in sample["resps"]] == pytest.approx(o["loglik"], rel=1e-4, abs=1e-4)
    # Generation: lm-eval's (HF generate, its stop handling) equals moe-lab's greedy batched generation.
    docs = load_generation_docs("gsm8k", DATA_DIR)["test"].select(range(LIMIT))
    until = result["configs"]["llm_adapters_gsm8k"]["generation_kwargs"]["until"]
    ours = generate(model, tok, docs["prompt"], max_new_tokens=16, stop=until)
    theirs = [s["resps"][0][0]
              for s in sorted(result["samples"]["llm_adapters_gsm8k"], key=lambda s: s["doc_id"])]
    assert theirs == [o[0] for o in ours]
    assert metrics["llm_adapters_gsm8k"]["acc"] == 0.0  # a random model does not solve GSM8K


def _byte_batch(seed, **kwargs):
    batch = random_batch(seed=seed, **kwargs)
    ids = batch["input_ids"] % BYTE_VOCAB_SIZE
    return {**batch, "input_ids": ids, "labels": ids.masked_fill(batch["attention_mask"] == 0, -100)}


def _train(model, patch, steps=3, lr=0.05):
    """A few real optimizer steps (router biases and condensers follow each step, as in task=finetune)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for step in range(steps):
        model(**_byte_batch(step)).loss.backward()
        opt.step()
        opt.zero_grad()
        patch.after_optimizer_step()
    return model.eval()


TRAINED = {  # method -> (options, what must have moved away from its initial value)
    "condenser": ({"gamma": 0.05, "n": 1, "selection": "in_run", "selection_updates": 1},
                  lambda patch: all(layer.forced_experts and bool(layer.bias.abs().max() > 0) for layer in patch.layers)),
    "compressed_experts": ({}, lambda patch: any(bool((p != 1).any()) for layer in patch.layers
                                                for p in layer.compressed_experts.parameters())),
}


@pytest.mark.parametrize("method", sorted(TRAINED))
def test_lm_eval_on_an_export_reinstalls_the_methods_routing(method, tok, tmp_path):
    """The logits lm-eval's wrapper computes on an export equal the trained model's, bit for bit: the export
    is vanilla weights + the method's routing files, and lm_eval_model re-installs that routing."""
    options, moved = TRAINED[method]
    model = build_tiny("olmoe", vocab_size=BYTE_VOCAB_SIZE)
    patch = moe_lab.apply(model, method, **options)
    _train(model, patch)
    assert moved(patch), "training must move the method's routing state (else this test could not fail)"
    patch.export(tmp_path / "export", tok)
    ids = _byte_batch(9, batch=2, seq=12, pad_rows=())["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits

    lm = lm_eval_model(tmp_path / "export", batch_size=2, device="cpu")
    assert any(isinstance(m, MoEBlock) for m in lm.model.modules()), "the method's routing was not re-installed"
    assert not lm.model.training
    got = lm._model_call(ids)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    # the control: the same export under vanilla HF routing is another model
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        assert not torch.allclose(vanilla(input_ids=ids).logits, expected, atol=1e-4)


def test_in_memory_patched_model_runs_the_commonsense_tag(tok):
    model = build_tiny("qwen2_moe")
    moe_lab.apply(model)
    result = evaluate_with_lm_eval(model, tok, ["llm_adapters_commonsense"], limit=2, batch_size=8,
                                   data_dir=DATA_DIR)
    metrics = lm_eval_metrics(result)
    assert {"llm_adapters_" + name for name in ("boolq", "piqa", "social_iqa", "winogrande", "arc_easy",
                                                "arc_challenge", "openbookqa")} <= set(metrics)
    assert all(0.0 <= metrics[t]["acc"] <= 1.0 for t in local_tasks() if t in metrics)
    assert model.training  # mode restored


def test_bad_calls_are_named(model, tok, tmp_path):
    with pytest.raises(ValueError, match="unknown lm-eval task.*hub_tasks=True"):
        evaluate_with_lm_eval(model, tok, ["hellaswag"], data_dir=DATA_DIR)
    with pytest.raises(ValueError, match="needs its tokenizer"):
        evaluate_with_lm_eval(model, None, ["llm_adapters_boolq"], data_dir=DATA_DIR)
    with pytest.raises(FileNotFoundError, match="data_dir"):
        evaluate_with_lm_eval(model, tok, ["llm_adapters_boolq"], data_dir=tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="checkpoint directory"):
        evaluate_with_lm_eval(tmp_path / "nowhere", None, ["llm_adapters_boolq"], data_dir=DATA_DIR)


def test_a_row_without_answer_is_named(tmp_path):
    (tmp_path / "boolq.test.json").write_text(
        '[{"instruction": "q1 Answer format: true/false", "input": "", "output": "", "answer": "true"},\n'
        ' {"instruction": "q2 Answer format: true/false", "input": "", "output": ""}]'
    )
    with pytest.raises(ValueError, match=r"boolq.test.json: row 1 \(line 2\).*answer"):
        load_choice_docs("boolq", tmp_path)
