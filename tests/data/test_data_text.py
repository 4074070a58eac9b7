import itertools
import json

import lightning as L
import pytest
import torch

from moe_lab.data.resumable import ResumableDataLoader
from moe_lab.data.text import TextBlockDataModule, TextBlockStream, document_ids, token_blocks
from moe_lab.data.tokenizer import build_byte_tokenizer
from moe_lab.methods.base import MoELightningModule
from tests.conftest import build_tiny

EOS = 2
DOCS = ["ab", "cde", "", "fghij", "k"]


def b(text):
    return [x + 3 for x in text.encode()]


def test_documents_and_blocks_by_hand():
    tok = build_byte_tokenizer()
    rows = [{"text": t} for t in DOCS]
    stream = b("ab") + [EOS] + b("cde") + [EOS] + [EOS] + b("fghij") + [EOS] + b("k") + [EOS]
    docs = list(document_ids(tok, rows, "text", "eos", "docs"))
    assert [t for d in docs for t in d] == stream
    assert list(token_blocks(docs, 4)) == [stream[0:4], stream[4:8], stream[8:12], stream[12:16]]
    assert list(token_blocks(docs, 4, limit=2)) == [stream[0:4], stream[4:8]]
    joined = [t for d in document_ids(tok, rows, "text", "\n\n", "docs") for t in d]
    assert joined == b("ab\n\ncde\n\n\n\nfghij\n\nk\n\n")  # "\n\n".join(...) + "\n\n"
    odd = [t for d in document_ids(tok, rows, "text", "eos", "docs", shard=(1, 2)) for t in d]
    assert odd == b("cde") + [EOS] + b("fghij") + [EOS]


def _jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return str(path)


def test_bad_text_row_names_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a"}\n{"body": "b"}\n')
    dm = TextBlockDataModule(path=str(path), streaming=False, block_size=2, tokenizer=build_byte_tokenizer())
    with pytest.raises(ValueError, match=r"docs\.jsonl: row 1 starting at line 2: required field 'text'"):
        dm.setup()


def test_in_memory_blocks_and_batches(tmp_path):
    texts = [f"document number {i} " * (i % 3 + 1) for i in range(30)]
    path = _jsonl(tmp_path / "docs.jsonl", texts)
    tok = build_byte_tokenizer()
    dm = TextBlockDataModule(path=path, streaming=False, block_size=16, batch_size=4, tokenizer=tok)
    dm.setup()
    stream = [t for text in texts for t in b(text) + [EOS]]
    n = len(stream) // 16
    assert dm.blocks["train"].tolist() == [stream[16 * i : 16 * (i + 1)] for i in range(n)]
    batches = list(dm.train_dataloader())
    assert torch.equal(torch.cat([x["input_ids"] for x in batches]), dm.blocks["train"])  # in order
    assert all(torch.equal(x["labels"], x["input_ids"]) and x["attention_mask"].all() for x in batches)
    assert dm.val_dataloader() == []
    capped = TextBlockDataModule(path=path, streaming=False, block_size=16, num_blocks=5, tokenizer=tok)
    capped.setup()
    assert torch.equal(capped.blocks["train"], dm.blocks["train"][:5])


def test_stream_shards_documents_and_resumes(tmp_path):
    texts = [f"doc {i}: " + "xyz" * i for i in range(40)]
    path = _jsonl(tmp_path / "docs.jsonl", texts)
    tok = build_byte_tokenizer()
    dm = TextBlockDataModule(path=path, streaming=True, num_blocks=12, block_size=8, batch_size=3, tokenizer=tok)
    loader = dm.train_dataloader()
    assert isinstance(loader.dataset, TextBlockStream) and len(loader) == 4
    batches = [x["input_ids"].tolist() for x in loader]
    stream = [t for text in texts for t in b(text) + [EOS]]
    assert [blk for batch in batches for blk in batch] == [stream[8 * i : 8 * (i + 1)] for i in range(12)]
    rank1 = TextBlockStream(lambda: ({"text": t} for t in texts), tok, "text", "eos", 8, 6, "docs", shard=(1, 2))
    odd_docs = [t for text in texts[1::2] for t in b(text) + [EOS]]
    assert [blk.tolist() for blk in rank1] == [odd_docs[8 * i : 8 * (i + 1)] for i in range(6)]
    first = dm.train_dataloader()
    assert [x["input_ids"].tolist() for x in itertools.islice(first, 3)] == batches[:3]
    resumed = TextBlockDataModule(path=path, streaming=True, num_blocks=12, block_size=8, batch_size=3,
                                  tokenizer=tok)
    resumed.load_state_dict(dm.state_dict())
    assert dm.state_dict() == {"train_loader": {"epoch": 0, "batches": 3, "examples": 9}}
    assert [x["input_ids"].tolist() for x in resumed.train_dataloader()] == batches[3:]


def test_text_config_errors(tmp_path):
    tok = build_byte_tokenizer()
    with pytest.raises(ValueError, match="dataset.num_blocks"):
        TextBlockDataModule(path="allenai/c4", name="en", streaming=True, tokenizer=tok)
    with pytest.raises(ValueError, match="num_workers=0"):
        TextBlockDataModule(path="allenai/c4", num_blocks=8, num_workers=2, tokenizer=tok)
    path = _jsonl(tmp_path / "wiki.jsonl", ["a"])
    with pytest.raises(ValueError, match="dataset.val_path="):
        TextBlockDataModule(path=path, streaming=False, val_split="validation", tokenizer=tok)
    short = TextBlockDataModule(path=path, streaming=False, block_size=64, tokenizer=tok)
    with pytest.raises(ValueError, match="lower dataset.block_size"):
        short.setup()


def test_text_blocks_train_a_tiny_moe_through_lightning(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [f"line {i} of the corpus" for i in range(50)])
    val = _jsonl(tmp_path / "valid.jsonl", [f"held out {i}" for i in range(20)])
    dm = TextBlockDataModule(path=train, streaming=False, block_size=32, batch_size=4, val_split="validation",
                             val_path=val, val_blocks=2, tokenizer=build_byte_tokenizer())
    trainer = L.Trainer(accelerator="cpu", max_steps=3, val_check_interval=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MoELightningModule(build_tiny("olmoe"), "sft", optim={"lr": 1e-3}), datamodule=dm)
    assert trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["val/loss"])
    assert isinstance(trainer.train_dataloader, ResumableDataLoader) and len(dm.blocks["val"]) == 2
