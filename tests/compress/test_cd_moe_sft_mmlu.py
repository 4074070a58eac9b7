"""MMLU training rows for CD-MoE's lightweight SFT (conf/dataset/mmlu_train.yaml, moe_lab/data/mmlu.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moe_lab.data.collate import IGNORE_INDEX
from moe_lab.data.mmlu import MMLUDataModule, mmlu_prompt, mmlu_rows
from moe_lab.data.tokenizer import build_byte_tokenizer
from tests.conftest import ROOT

ROWS = [
    {"question": "  What is the largest organ of the human body? ", "subject": "anatomy",
     "choices": ["Liver", "Skin", "Heart", "Lung"], "answer": 1},
    {"question": "Which gas do plants take in?", "subject": "", "choices": ["Oxygen", "Nitrogen", "Carbon dioxide",
                                                                          "Helium"], "answer": 2},
    {"question": "2 + 2 = ?", "subject": "elementary_mathematics", "choices": ["3", "4", "5", "22"], "answer": 1},
]


def _lm_eval_mmlu(doc: dict, subject: str) -> tuple[str, str]:
    """lm-eval's own zero-shot MMLU context and gold continuation, rendered from its installed task files."""
    import lm_eval
    from lm_eval.utils import apply_template

    folder = Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "default"
    template = yaml.safe_load((folder / "_default_template_yaml").read_text())
    description = yaml.safe_load((folder / f"mmlu_{subject}.yaml").read_text())["description"]
    target_delimiter = template.get("target_delimiter", " ")
    return (description + apply_template(template["doc_to_text"], doc),
            target_delimiter + template["doc_to_choice"][doc[template["doc_to_target"]]])


@pytest.mark.parametrize("row", [ROWS[0], ROWS[2]])
def test_prompt_and_response_are_lm_evals_mmlu_context_and_target(row):
    context, target = _lm_eval_mmlu(row, row["subject"])
    [mine] = mmlu_rows([row], "fixture")
    assert mine["instruction"] == context == mmlu_prompt(row["question"], row["choices"], row["subject"])
    assert mine["output"] == target and mine["answer"] == target.strip()


def test_rows_without_subject_and_letter_text_response():
    [row] = mmlu_rows([ROWS[1]], "fixture", response="letter_text")
    assert row["instruction"] == ("The following are multiple choice questions (with answers).\n\n"
                                  "Which gas do plants take in?\nA. Oxygen\nB. Nitrogen\nC. Carbon dioxide\n"
                                  "D. Helium\nAnswer:")
    assert row["output"] == " C. Carbon dioxide"


def _compose_dataset(path: Path, *overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf" / "dataset"), version_base="1.3"):
        return compose("mmlu_train", overrides=[f"path={path}", *overrides])


def test_config_keeps_the_hub_id():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf" / "dataset"), version_base="1.3"):
        cfg = compose("mmlu_train")
    assert (cfg.path, cfg.name, cfg.split, cfg.max_length, cfg.batch_size) == ("cais/mmlu", "auxiliary_train",
                                                                               "train", 256, 8)


@pytest.mark.parametrize("fmt", ["json", "parquet_nested"])
def test_datamodule_trains_only_the_answer_letter(tmp_path, fmt):
    """Local fixtures through the config: a flat JSON array, and parquet rows nested under "train" as in
    cais/mmlu's auxiliary_train config. Trained tokens are exactly " <letter>" + eos."""
    from datasets import Dataset
    from hydra.utils import instantiate

    if fmt == "json":
        path = tmp_path / "mmlu.json"
        path.write_text(json.dumps(ROWS))
    else:
        path = tmp_path / "mmlu.parquet"
        Dataset.from_list([{"train": r} for r in ROWS]).to_parquet(str(path))
    tok = build_byte_tokenizer()
    dm = instantiate(_compose_dataset(path, "max_length=512"), tokenizer=tok)
    dm.setup()
    examples = dm.examples["train"]
    assert len(examples) == 3 and not dm.rows["val"]
    by_prompt = {mmlu_prompt(r["question"], r["choices"], r["subject"]): r for r in ROWS}
    for ex in examples:
        ids, labels = list(ex["input_ids"]), list(ex["labels"])
        n_prompt = labels.index(next(x for x in labels if x != IGNORE_INDEX))
        assert all(x == IGNORE_INDEX for x in labels[:n_prompt]) and labels[n_prompt:] == ids[n_prompt:]
        prompt = tok.decode(ids[:n_prompt], skip_special_tokens=True)
        row = by_prompt[prompt]
        assert ids[n_prompt:] == tok(" " + "ABCD"[row["answer"]], add_special_tokens=False)["input_ids"] + [
            tok.eos_token_id]


def test_bad_rows_name_the_field_and_line(tmp_path):
    from hydra.utils import instantiate

    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [ROWS[0], {**ROWS[1], "answer": 4}]))
    dm = instantiate(_compose_dataset(path), tokenizer=build_byte_tokenizer())
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1 starting at line 2: field 'answer' must be a choice "
                                         r"index 0..3"):
        dm.setup()
    with pytest.raises(ValueError, match="field 'choices'"):
        mmlu_rows([{**ROWS[0], "choices": "A B"}], "x")
    with pytest.raises(ValueError, match="dataset.response='word'"):
        MMLUDataModule(str(path), response="word")
