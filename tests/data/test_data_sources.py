import json
from types import SimpleNamespace

import pytest
from datasets import Dataset, DatasetDict

from moe_lab.data import sources
from moe_lab.data.datamodule import SFTDataModule
from moe_lab.data.sources import is_local, is_url, read_rows
from moe_lab.data.tokenizer import build_byte_tokenizer

ROWS = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(4)]


def test_local_file_formats(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps(ROWS, indent=2))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    Dataset.from_list(ROWS).to_parquet(str(tmp_path / "rows.parquet"))
    Dataset.from_list(ROWS).to_csv(str(tmp_path / "rows.csv"), index=False)
    for suffix in ("json", "jsonl", "parquet", "csv"):
        assert read_rows(str(tmp_path / f"rows.{suffix}")) == ROWS, suffix
    (tmp_path / "lines.txt").write_text("first line\nsecond line\n")
    assert read_rows(str(tmp_path / "lines.txt")) == [{"text": "first line"}, {"text": "second line"}]
    with pytest.raises(ValueError, match="Cannot tell the format"):
        (tmp_path / "rows.xml").write_text("<rows/>")
        read_rows(str(tmp_path / "rows.xml"))


def test_saved_dataset_folder_and_splits(tmp_path):
    DatasetDict({"train": Dataset.from_list(ROWS), "validation": Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(tmp_path / "saved"))
    assert read_rows(str(tmp_path / "saved")) == ROWS
    assert read_rows(str(tmp_path / "saved"), split="validation") == ROWS[:1]


def test_local_url_and_hub_are_told_apart(tmp_path):
    assert is_local(str(tmp_path)) and is_local("./x.json") and is_local("data.jsonl")
    assert not is_local("allenai/tulu-3-sft-mixture") and not is_local("https://example.org/x.json")
    assert is_url("https://example.org/x.json") and not is_url("allenai/c4")


def test_url_goes_through_the_json_builder(monkeypatch):
    seen = {}

    def fake_load_dataset(builder, *args, **kwargs):
        seen.update(builder=builder, **kwargs)
        return Dataset.from_list(ROWS)

    monkeypatch.setattr(sources, "load_dataset", fake_load_dataset)
    assert read_rows("https://example.org/data/rows.jsonl") == ROWS
    assert seen == {"builder": "json", "data_files": "https://example.org/data/rows.jsonl", "split": "train",
                    "streaming": False}
    read_rows("org/name", split="test", name="cfg")
    assert seen["builder"] == "org/name" and seen["split"] == "test"


def test_datamodule_shards_train_batches_across_ranks():
    examples = {}
    for rank in range(2):
        dm = SFTDataModule(source="synthetic", num_examples=31, val_fraction=0.0, max_length=512, batch_size=4,
                           tokenizer=build_byte_tokenizer())
        dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank})
        dm.setup()
        loader = dm.train_dataloader()
        assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, rank) and len(loader) == 4
        examples[rank] = [tuple(row[m.bool()].tolist()) for batch in loader
                          for row, m in zip(batch["input_ids"], batch["attention_mask"])]
    everything = sorted(tuple(ex["input_ids"]) for ex in dm.examples["train"])
    assert len(examples[0]) == len(examples[1]) == 16  # 31 padded to 32 (DistributedSampler's rule)
    assert sorted(set(examples[0]) | set(examples[1])) == everything


def test_json_syntax_error_names_line_and_column(tmp_path):
    lines = tmp_path / "broken.jsonl"
    lines.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "c", "output": }\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 3, column 32: invalid JSON"):
        read_rows(str(lines))
    array = tmp_path / "broken.json"
    array.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c" "output": "d"}\n]')
    with pytest.raises(ValueError, match=r"broken\.json: line 3, column 23: invalid JSON"):
        read_rows(str(array))
