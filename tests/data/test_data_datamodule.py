import ast
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DistributedSampler

from moe_lab.data.collate import pad_collate
from moe_lab.data.datamodule import SFTDataModule
from moe_lab.data.shipped import LLM_ADAPTERS_DIR
from moe_lab.data.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer

REPO = Path(__file__).resolve().parents[2]
MATH_DATA = LLM_ADAPTERS_DIR / "math_data.json"


def _check_batch(batch, batch_size, max_length):
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.dtype == mask.dtype == labels.dtype == torch.long
    assert ids.shape == mask.shape == labels.shape
    assert ids.shape[0] == batch_size and ids.shape[1] <= max_length
    assert mask[:, 0].all()  # right padding: every row starts with real tokens
    assert (mask.sum(1) == (mask.cumsum(1) == torch.arange(1, ids.shape[1] + 1)).sum(1)).all()
    assert (ids[mask == 0] == 0).all() and (labels[mask == 0] == -100).all()
    real = labels != -100
    assert real.any(1).all()  # every example trains on at least one token
    assert (labels[real] == ids[real]).all()
    assert (ids[:, 0] == 1).all()  # bos


def _dm(**kw):
    args = {"source": "synthetic", "num_examples": 100, "max_length": 512, "batch_size": 8}
    return SFTDataModule(**{**args, "tokenizer": build_byte_tokenizer(), **kw})


def test_synthetic_split_and_batches():
    dm = _dm()
    dm.setup("fit")
    assert len(dm.rows["train"]) == 95 and len(dm.rows["val"]) == 5
    all_instr = [r["instruction"] for r in dm.rows["train"] + dm.rows["val"]]
    assert len(set(all_instr)) == len(all_instr) == 100  # disjoint split covering all rows
    for batch in dm.train_dataloader():
        _check_batch(batch, min(8, batch["input_ids"].shape[0]), 512)
    val = next(iter(dm.val_dataloader()))
    _check_batch(val, 5, 512)
    gold = dm.gold_answers("val")
    assert gold == [
        str(eval(compile(ast.parse(r["expression"], mode="eval"), "<e>", "eval"))) for r in dm.rows["val"]
    ]
    assert len(dm.gold_answers("train")) == 95


def test_deterministic_for_same_seed():
    a, b, c = _dm(seed=3), _dm(seed=3), _dm(seed=4)
    for dm in (a, b, c):
        dm.setup("fit")
    batches_a = [x["input_ids"] for x in a.train_dataloader()]
    batches_b = [x["input_ids"] for x in b.train_dataloader()]
    assert all(torch.equal(x, y) for x, y in zip(batches_a, batches_b, strict=True))
    assert a.gold_answers() == b.gold_answers()
    assert [r["instruction"] for r in a.rows["val"]] != [r["instruction"] for r in c.rows["val"]]
    # shuffled: the first batch is not the first 8 train examples in split order
    assert not torch.equal(batches_a[0], pad_collate(a.examples["train"][:8], pad_id=0)["input_ids"])


def test_truncation_skips_are_counted():
    dm = _dm(max_length=300, num_examples=20)
    dm.setup()
    assert dm.num_skipped["train"] + len(dm.examples["train"]) == len(dm.rows["train"])
    assert dm.num_skipped["train"] > 0
    for ex in dm.examples["train"]:
        assert len(ex["input_ids"]) <= 300 and any(x != -100 for x in ex["labels"])


def test_all_examples_truncated_is_an_error():
    with pytest.raises(ValueError, match="max_length=64"):
        _dm(max_length=64, num_examples=10).setup()


def test_bad_source_and_missing_tokenizer():
    with pytest.raises(ValueError, match="synthetic, llm_adapters"):
        SFTDataModule(source="nope")
    dm = SFTDataModule(source="synthetic", num_examples=10, max_length=512)
    with pytest.raises(ValueError, match="tokenizer"):
        dm.setup()
    dm.set_tokenizer(build_byte_tokenizer())
    dm.setup()
    assert len(dm.examples["train"]) == 9


def test_distributed_sampler_shards_train_split():
    from lightning.pytorch.utilities.data import _update_dataloader

    dm = _dm(num_examples=40, batch_size=4)
    dm.setup()
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(
            dm.train_dataloader().dataset, num_replicas=2, rank=rank, shuffle=True, seed=0
        )
        loader = _update_dataloader(dm.train_dataloader(), sampler)
        for batch in loader:
            _check_batch(batch, batch["input_ids"].shape[0], 512)
            seen += [
                tuple(row[m.bool()].tolist()) for row, m in zip(batch["input_ids"], batch["attention_mask"])
            ]
    assert sorted(seen) == sorted(tuple(ex["input_ids"]) for ex in dm.examples["train"])


def test_math_data_capped():
    def capped():
        return SFTDataModule(source="llm_adapters", path=str(MATH_DATA), num_examples=64, max_length=1024,
                             batch_size=8, tokenizer=build_byte_tokenizer())

    dm = capped()
    dm.setup()
    assert len(dm.rows["train"]) + len(dm.rows["val"]) == 64 and len(dm.rows["val"]) == 3
    _check_batch(next(iter(dm.train_dataloader())), 8, 1024)
    assert all(isinstance(a, str) and a for a in dm.gold_answers())  # numbers, or letters for AQuA rows
    dm2 = capped()
    dm2.setup()
    assert dm.rows == dm2.rows
    assert all(
        torch.equal(x["input_ids"], y["input_ids"])
        for x, y in zip(dm.train_dataloader(), dm2.train_dataloader())
    )


def _compose(name, overrides=()):
    with initialize_config_dir(config_dir=str(REPO / "conf" / "dataset"), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def test_hydra_configs_instantiate(monkeypatch):
    tok = build_byte_tokenizer()
    cfg = _compose("synthetic_math")
    assert (cfg.source, cfg.num_examples, cfg.max_length, cfg.batch_size) == ("synthetic", 2000, 512, 8)
    dm = instantiate(cfg, num_examples=50, tokenizer=tok)
    assert isinstance(dm, SFTDataModule) and dm.tokenizer is tok and dm.source == "synthetic"
    dm.setup()
    _check_batch(next(iter(dm.train_dataloader())), 8, 512)

    with pytest.raises(Exception, match="path"):
        OmegaConf.to_container(_compose("llm_adapters"), resolve=True, throw_on_missing=True)

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("MOE_LAB_DATA_DIR", raising=False)
    cfg = _compose("math_data")
    assert cfg.source == "llm_adapters"
    assert Path(cfg.path).resolve() == MATH_DATA.resolve()
    monkeypatch.setenv("MOE_LAB_DATA_DIR", "/elsewhere")
    assert _compose("math_data").path == "/elsewhere/math_data.json"


def test_dataset_group_in_a_primary_config(tmp_path, monkeypatch):
    shutil.copytree(REPO / "conf" / "dataset", tmp_path / "dataset")
    (tmp_path / "config.yaml").write_text("defaults:\n  - dataset: math_data\n  - _self_\nseed: 5\n")
    monkeypatch.setenv("MOE_LAB_DATA_DIR", "/data")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["dataset.seed=${seed}", "dataset.num_examples=8"])
        synth = compose(config_name="config", overrides=["dataset=synthetic_math"])
    assert set(cfg) == {"dataset", "seed"}
    assert (cfg.dataset.source, cfg.dataset.path, cfg.dataset.seed) == (
        "llm_adapters",
        "/data/math_data.json",
        5,
    )
    assert cfg.dataset._target_ == "moe_lab.data.datamodule.SFTDataModule" and "tokenizer" not in cfg.dataset
    assert synth.dataset.source == "synthetic" and synth.dataset.path is None


class _TinyLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(BYTE_VOCAB_SIZE, 8)
        self.out = torch.nn.Linear(8, BYTE_VOCAB_SIZE)

    def _loss(self, batch):
        logits = self.out(self.emb(batch["input_ids"]))[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, BYTE_VOCAB_SIZE), batch["labels"][:, 1:].reshape(-1)
        )

    def training_step(self, batch, _):
        return self._loss(batch)

    def validation_step(self, batch, _):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_fit_smoke(tmp_path):
    trainer = L.Trainer(
        fast_dev_run=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_TinyLM(), datamodule=_dm(num_examples=40, batch_size=4))
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
