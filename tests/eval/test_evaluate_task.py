"""task=evaluate: predictions against vanilla HF generation, resume, results tables, checkpoints, W&B, run.py."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moe_lab.data.prompts import format_prompt
from moe_lab.eval.results import ResultsTable, collect
from moe_lab.eval.results import main as results_main
from moe_lab.eval.score import main as score_main
from moe_lab.models import load_model
from moe_lab.runs.evaluate import evaluate
from tests.conftest import DATA_DIR, ROOT, tiny_model_cfg

STOPS = ["### Instruction:", "\nBelow is an instruction"]


def eval_cfg(out, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[
            "task=evaluate", f"paths.output_dir={out}", f"paths.data_dir={DATA_DIR}", "logger=none", *overrides,
        ])


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def hf_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Vanilla HF greedy decoding of one unpadded prompt, cut at eos and at the stop strings; ids past the
    tokenizer's vocabulary (the tiny models pad it) are suppressed, as moe-lab's generation does."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         suppress_tokens=list(range(len(tokenizer), model.config.vocab_size)))
    new = out[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    text = tokenizer.decode(new, skip_special_tokens=True)
    return text[: min([text.find(s) for s in STOPS if s in text], default=len(text))]


# ----------------------------------------------------------------------------------------------------
# Results tables


def test_results_table_csv_markdown_average_and_merge(tmp_path):
    table = ResultsTable()
    table.add("olmoe", "sft", "GSM8K", 50.0)
    table.add("olmoe", "sft", "AQuA", 25.0)
    table.add("olmoe", "sft", "WikiText-2", 12.3456, averaged=False)
    table.add("olmoe", "condenser", "GSM8K", 60.0)
    table.add("olmoe", "condenser", "AQuA", None)  # skipped: no value
    assert table.header() == ["model", "method", "GSM8K", "AQuA", "Avg.", "WikiText-2"]
    assert table.average(("olmoe", "sft")) == (37.5, 2) and table.average(("olmoe", "condenser")) == (60.0, 1)
    table.write_csv(tmp_path / "r.csv")
    assert (tmp_path / "r.csv").read_text().splitlines() == [
        "model,method,GSM8K,AQuA,Avg.,WikiText-2,n_averaged",
        "olmoe,sft,50.0,25.0,37.5,12.35,2",
        "olmoe,condenser,60.0,,60.0,,1",
    ]
    assert table.to_markdown().splitlines() == [
        "| model | method | GSM8K | AQuA | Avg. | WikiText-2 |",
        "|---|---|---|---|---|---|",
        "| olmoe | sft | 50.0 | 25.0 | 37.5 | 12.35 |",
        "| olmoe | condenser | 60.0 | – | 60.0* | – |",
        "",
        "\\* average over the datasets with a result only (others skipped or unavailable)",
    ]
    other = ResultsTable.from_json(table.to_json(), table.columns)
    assert other.records() == table.records()
    ppl_only = ResultsTable()
    ppl_only.add("m", "base", "WikiText-2", 30.0, averaged=False)
    assert ppl_only.header() == ["model", "method", "WikiText-2"]  # no average of nothing


# ----------------------------------------------------------------------------------------------------
# The task in-process


def test_predictions_equal_vanilla_hf_greedy_and_score_like_the_cli(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = eval_cfg(out, "eval=math7", "eval.datasets=[gsm8k,aqua]", "eval.limit=3", "eval.batch_size=1",
                   "eval.generation.max_new_tokens=12")
    metrics = evaluate(cfg)
    model, tokenizer = load_model(tiny_model_cfg("olmoe"))
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["model"], summary["method"], summary["limit"]) == ("tiny_olmoe", "base", 3)
    for name, file in (("gsm8k", "gsm8k.test.json"), ("aqua", "AQuA.test.json")):
        rows = json.loads((DATA_DIR / file).read_text())[:3]
        preds = read_jsonl(out / "predictions" / f"{name}.jsonl")
        assert [p["id"] for p in preds] == [0, 1, 2]
        for p, row in zip(preds, rows):
            assert p["prediction"] == hf_greedy(model, tokenizer, format_prompt(row["instruction"]), 12)
        # the scoring CLI on the run's predictions file gives the run's numbers
        capsys.readouterr()
        assert score_main(["--dataset", name, "--predictions", str(out / "predictions" / f"{name}.jsonl"),
                           "--data-dir", str(DATA_DIR)]) == 0
        cli = json.loads(capsys.readouterr().out.splitlines()[-1])
        ds = summary["datasets"][name]
        assert cli["n_correct"] == ds["n_correct"] and ds["n_rows"] == 3 and ds["n_total_rows"] == len(
            json.loads((DATA_DIR / file).read_text()))
        assert metrics[f"eval/{name}/acc"] == ds["value"]
        scored = read_jsonl(out / "predictions" / f"{name}.scored.jsonl")
        assert len(scored) == 3 and dict(Counter(s["status"] for s in scored)) == ds["statuses"]
    with open(out / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["model"] == "tiny_olmoe" and float(row["GSM8K"]) == 100 * summary["datasets"]["gsm8k"]["value"]
    assert "| model | method | GSM8K | AQuA | Avg. |" in (out / "results.md").read_text()


def test_rerun_resumes_and_skips_finished_rows(tmp_path, monkeypatch):
    from moe_lab.eval import generation

    out = tmp_path / "run"
    common = ("eval=math7", "eval.datasets=[svamp,aqua]", "eval.batch_size=2", "eval.generation.max_new_tokens=6")
    evaluate(eval_cfg(out, *common, "eval.limit=3"))
    first = {n: (out / "predictions" / f"{n}.jsonl").read_text() for n in ("svamp", "aqua")}
    prompts_seen: list[str] = []
    real = generation.generate

    def counting(model, tokenizer, prompts, **kw):
        prompts_seen.extend(prompts)
        return real(model, tokenizer, prompts, **kw)

    monkeypatch.setattr(generation, "generate", counting)
    # an interrupted run: svamp lost its last row and has a half-written line; aqua lost its last newline
    lines = first["svamp"].splitlines(keepends=True)
    (out / "predictions" / "svamp.jsonl").write_text("".join(lines[:2]) + '{"id": 2, "predi')
    (out / "predictions" / "aqua.jsonl").write_text(first["aqua"].rstrip("\n"))
    evaluate(eval_cfg(out, *common, "eval.limit=3"))
    svamp_row2 = json.loads((DATA_DIR / "SVAMP.test.json").read_text())[2]["instruction"]
    assert len(prompts_seen) == 1 and svamp_row2 in prompts_seen[0]
    assert {n: (out / "predictions" / f"{n}.jsonl").read_text() for n in first} == first
    prompts_seen.clear()
    evaluate(eval_cfg(out, *common, "eval.limit=4"))  # a larger limit adds only the new rows
    assert len(prompts_seen) == 2
    assert [p["id"] for p in read_jsonl(out / "predictions" / "aqua.jsonl")] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"other settings \(generation.max_new_tokens: 6 -> 7\).*hydra.run.dir"):
        evaluate(eval_cfg(out, "eval=math7", "eval.datasets=[svamp]", "eval.generation.max_new_tokens=7"))


def test_commonsense_loglik_wiring_and_unavailable_hellaswag(tmp_path):
    from moe_lab.eval.choices import choice_item

    out = tmp_path / "run"
    evaluate(eval_cfg(out, "eval=commonsense8", "eval.datasets=[boolq,hellaswag,winogrande]", "eval.limit=2",
                      "eval.generation.max_new_tokens=4"))
    summary = json.loads((out / "summary.json").read_text())
    assert "eval.paths.hellaswag=/local/path" in summary["skipped"]["hellaswag"]
    assert set(summary["datasets"]) == {"boolq", "winogrande"}
    header = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert header[:6] == ["model", "method", "BoolQ", "HellaSwag", "WinoGrande", "Avg."]
    # the log-likelihood of each option equals an independent sum of HF log-probabilities
    model, tokenizer = load_model(tiny_model_cfg("olmoe"))
    rows = json.loads((DATA_DIR / "winogrande.test.json").read_text())[:2]
    records = read_jsonl(out / "predictions" / "winogrande.mc.jsonl")
    for row, rec in zip(rows, records):
        item = choice_item("option", row["instruction"], row["answer"])
        for choice, ll in zip(item.choices, rec["loglik"]):
            ctx = tokenizer(item.context).input_ids
            full = tokenizer(item.context + choice).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([full])).logits[0, :-1].float(), -1)
            expected = sum(logp[t - 1, full[t]].item() for t in range(len(ctx), len(full)))
            assert ll == pytest.approx(expected, abs=1e-4)
        assert rec["pred"] == max(range(2), key=lambda j: rec["loglik"][j])
    mc = summary["datasets"]["winogrande"]["loglik"]
    golds = [choice_item("option", r["instruction"], r["answer"]).gold for r in rows]
    assert mc["value"] == sum(r["pred"] == g for r, g in zip(records, golds)) / 2


def test_hellaswag_from_a_local_hub_format_file(tmp_path):
    path = tmp_path / "hellaswag.jsonl"
    rows = [{"activity_label": "Drums", "ctx": "A man sits at the drums. He", "label": "1",
             "endings": ["eats soup.", "plays a beat.", "sleeps.", "leaves."]}] * 2
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    evaluate(eval_cfg(out, "eval=commonsense8", "eval.datasets=[hellaswag]", f"eval.paths.hellaswag={path}",
                      "eval.generation.max_new_tokens=4"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped"] == {} and summary["datasets"]["hellaswag"]["n_rows"] == 2
    assert len(read_jsonl(out / "predictions" / "hellaswag.mc.jsonl")) == 2


def test_perplexity_group_on_a_local_text(tmp_path):
    text = "The quick brown fox jumps over the lazy dog.\n\nA second paragraph of plain text."
    path = tmp_path / "wiki.txt"
    path.write_text(text)
    out = tmp_path / "run"
    metrics = evaluate(eval_cfg(out, "eval=ppl", f"eval.paths.wikitext2={path}"))
    model, tokenizer = load_model(tiny_model_cfg("olmoe"))
    ids = torch.tensor([tokenizer(text).input_ids])  # one window: ppl = exp(mean next-token loss)
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert metrics["eval/wikitext2/ppl"] == pytest.approx(torch.exp(torch.tensor(loss)).item(), rel=1e-4)
    assert "| model | method | WikiText-2 |" in (out / "results.md").read_text()


def test_hard_reasoning_samples_and_esft_raw_prompts(tmp_path):
    aime = tmp_path / "aime.jsonl"
    aime.write_text("".join(json.dumps({"id": i, "problem": f"Compute {i}+1.", "answer": str(i + 1)}) + "\n"
                            for i in range(2)))
    out = tmp_path / "hard"
    evaluate(eval_cfg(out, "eval=hard_reasoning", "eval.datasets=[aime24]", f"eval.paths.aime24={aime}",
                      "eval.generation.max_new_tokens=5"))
    preds = read_jsonl(out / "predictions" / "aime24.jsonl")
    assert [p["id"] for p in preds] == [0, 1] and all(len(p["prediction"]) == 4 for p in preds)
    assert len({tuple(p["prediction"]) for p in preds}) == 2  # sampled, seeded per prompt
    summary = json.loads((out / "summary.json").read_text())["datasets"]["aime24"]
    assert summary["metric"] == "pass@1" and sum(summary["statuses"].values()) == 8

    gold = '{"intent": "Weather-Query", "slots": {"city": "Tianjin"}}'
    intent = tmp_path / "intent.jsonl"
    rows = [{"idx": 2 * i, "prompt": f"User: weather in Tianjin {i}?\n\nAssistant:", "raw_answers": [gold]}
            for i in range(2)]
    intent.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "esft"
    evaluate(eval_cfg(out, "eval=esft", "eval.datasets=[esft_intent]", f"eval.paths.esft_intent={intent}",
                      "eval.generation.max_new_tokens=6", "eval.batch_size=1"))
    model, tokenizer = load_model(tiny_model_cfg("olmoe"))
    preds = read_jsonl(out / "predictions" / "esft_intent.jsonl")
    assert [p["id"] for p in preds] == [0, 2]  # the rows' own ids
    assert [p["prediction"] for p in preds] == [hf_greedy(model, tokenizer, r["prompt"], 6) for r in rows]


def test_checkpoints_export_dir_and_lightning_ckpt(tmp_path):
    import moe_lab

    model, tokenizer = load_model(tiny_model_cfg("qwen3_moe"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    run = tmp_path / "train"
    (run / "checkpoints").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"model": OmegaConf.to_container(tiny_model_cfg("qwen3_moe")),
                                     "method": {"name": "frozen_router"}}), run / "config.yaml")
    patch = moe_lab.apply(model, "frozen_router")
    patch.export(run / "export", tokenizer=tokenizer)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "hyper_parameters": {"method": "frozen_router", "options": {}, "name": "frozen_router"}},
               run / "checkpoints" / "last.ckpt")
    common = ("eval=math7", "eval.datasets=[addsub]", "eval.limit=2", "eval.generation.max_new_tokens=6")
    evaluate(eval_cfg(tmp_path / "a", *common, f"task.checkpoint={run / 'export'}"))
    evaluate(eval_cfg(tmp_path / "b", *common, f"task.checkpoint={run / 'checkpoints' / 'last.ckpt'}"))
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    assert (a["model"], a["method"]) == (b["model"], b["method"]) == ("tiny_qwen3_moe", "frozen_router")
    preds_a, preds_b = (read_jsonl(tmp_path / d / "predictions" / "addsub.jsonl") for d in "ab")
    assert preds_a == preds_b  # same weights either way
    rows = json.loads((DATA_DIR / "AddSub.test.json").read_text())[:2]
    patch.remove()
    model.eval()
    assert [p["prediction"] for p in preds_a] == [hf_greedy(model, tokenizer, format_prompt(r["instruction"]), 6)
                                                 for r in rows]
    # results of several runs merge into one table
    table = collect([tmp_path / "a", tmp_path / "b"])
    assert list(table.cells) == [("tiny_qwen3_moe", "frozen_router")]
    assert results_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "results.csv").read_text().splitlines()[1].startswith("tiny_qwen3_moe,frozen_router,")
    assert results_main([str(tmp_path / "train")]) == 2  # not a task=evaluate run directory
    assert results_main([str(tmp_path)]) == 0  # a directory of runs (a sweep) stands for the runs in it
    torch.save({"weights": {}}, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match="not a Lightning checkpoint written by task=finetune"):
        evaluate(eval_cfg(tmp_path / "c", *common, f"task.checkpoint={tmp_path / 'bad.ckpt'}"))
    with pytest.raises(FileNotFoundError, match="task.checkpoint=.*no such file"):
        evaluate(eval_cfg(tmp_path / "c", *common, f"task.checkpoint={tmp_path / 'nope'}"))


def test_bad_eval_configuration_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match=re.escape("eval=math7 | eval=commonsense8")):
        evaluate(eval_cfg(tmp_path))  # no eval= group
    with pytest.raises(ValueError, match="unknown evaluation set 'gsm9k': choose one of gsm8k"):
        evaluate(eval_cfg(tmp_path, "eval=math7", "eval.datasets=[gsm9k]"))
    with pytest.raises(EnvironmentError, match="eval.paths.aime24"):
        evaluate(eval_cfg(tmp_path, "eval=hard_reasoning", "eval.datasets=[aime24]", "eval.on_unavailable=error"))


def test_wandb_table_is_logged_offline(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    out = tmp_path / "run"
    try:
        evaluate(eval_cfg(out, "eval=math7", "eval.datasets=[singleeq]", "eval.limit=2",
                          "eval.generation.max_new_tokens=4", "logger=wandb", "logger.wandb.offline=true"))
    finally:
        wandb.finish()
    (table_file,) = (out / "wandb").glob("offline-run-*/files/media/table/eval/results_*.table.json")
    logged = json.loads(table_file.read_text())
    assert logged["columns"] == ["model", "method", "SingleEq", "Avg."]
    with open(out / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert logged["data"] == [["tiny_olmoe", "base", float(row["SingleEq"]), float(row["Avg."])]]
    assert (out / "metrics.csv").read_text().splitlines()[0].split(",") == ["eval/avg", "eval/singleeq/acc", "step"]


# ----------------------------------------------------------------------------------------------------
# run.py end to end


def run_py(*overrides, cwd):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "MOE_LAB_DATA_DIR": str(DATA_DIR)}
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
def test_run_py_math7(tmp_path):
    out = tmp_path / "run"
    proc = run_py("task=evaluate", "eval=math7", "model=tiny_olmoe", "eval.limit=8",
                  "eval.generation.max_new_tokens=32", f"hydra.run.dir={out}", cwd=tmp_path)
    header = "| model | method | GSM8K | SVAMP | MultiArith | AddSub | AQuA | SingleEq | MAWPS | Avg. |"
    assert header in proc.stdout and f"Output directory: {out}" in proc.stdout
    assert "gsm8k: acc = " in proc.stdout and "coverage 8/8" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["datasets"]) == {"gsm8k", "svamp", "multiarith", "addsub", "aqua", "singleeq", "mawps"}
    for name in summary["datasets"]:
        assert len(read_jsonl(out / "predictions" / f"{name}.jsonl")) == 8
    assert (out / "results.csv").read_text().startswith("model,method,GSM8K,SVAMP")


@pytest.mark.slow
def test_run_py_commonsense8(tmp_path):
    out = tmp_path / "run"
    proc = run_py("task=evaluate", "eval=commonsense8", "model=tiny_olmoe", "eval.limit=8",
                  f"hydra.run.dir={out}", cwd=tmp_path)
    assert "hellaswag: skipped (" in proc.stdout and "eval.paths.hellaswag" in proc.stdout
    assert "| model | method | BoolQ | PIQA | SIQA | HellaSwag | WinoGrande | ARC-e | ARC-c | OBQA | Avg." in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["datasets"]) == 7 and list(summary["skipped"]) == ["hellaswag"]
    assert all(s["loglik"]["n_predicted"] == 8 for s in summary["datasets"].values())
