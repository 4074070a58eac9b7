"""Exact mid-epoch resume: a run stopped at step k and resumed equals an uninterrupted run, weight for weight."""

import itertools
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from moe_lab.data.datamodule import ListDataset, SFTDataModule
from moe_lab.data.resumable import ResumableDataLoader, ResumableSampler
from moe_lab.data.tokenizer import build_byte_tokenizer
from moe_lab.methods.base import MoELightningModule
from tests.conftest import build_tiny

N_TRAIN, BATCH = 10, 4  # 3 batches per epoch (4, 4, 2): 6 steps = 2 epochs


def write_chat_file(directory) -> str:
    """``N_TRAIN`` one-turn arithmetic chats as ``<directory>/chat.jsonl``."""
    path = directory / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{i} + {i + 2} = ?"},
                          {"role": "assistant", "content": f"{2 * i + 2}"}]} for i in range(N_TRAIN)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_chat_file(tmp_path_factory.mktemp("data"))


def chat_datamodule(chat_file, cls=SFTDataModule):
    return cls(source="chat", path=chat_file, val_fraction=0.0, max_length=64, batch_size=BATCH, seed=0,
               tokenizer=build_byte_tokenizer())


def train(datamodule, make_module, ckpt_dir=None, ckpt_path=None, save_every=1, **limits):
    """Seed 0, ``make_module()``, fit (6 steps unless ``max_steps`` is given; a checkpoint ``step=<n>.ckpt`` every
    ``save_every`` steps in ``ckpt_dir``; resumed from ``ckpt_path``). Returns the module and its trainer."""
    L.seed_everything(0)
    module = make_module()
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=save_every,
                                 save_top_k=-1)] \
        if ckpt_dir else []
    limits = {"max_steps": 6, **limits}
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
                        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=ckpt_dir, **limits)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    assert trainer.global_step == (limits["max_steps"] if limits["max_steps"] > 0 else 6)
    return module, trainer


def _fit(datamodule, ckpt_dir=None, ckpt_path=None, save_every=1, **limits):
    module, _ = train(datamodule, lambda: MoELightningModule(build_tiny("olmoe"), "sft", optim={"lr": 1e-2}),
                      ckpt_dir, ckpt_path, save_every, **limits)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def straight(chat_file, tmp_path_factory):
    """One uninterrupted 6-step run that also writes a checkpoint after every step."""
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    return _fit(chat_datamodule(chat_file), ckpt_dir=str(ckpt_dir)), ckpt_dir


@pytest.mark.parametrize("stop", [2, 3, 4], ids=["mid_epoch0", "epoch_boundary", "mid_epoch1"])
def test_resume_equals_uninterrupted_run(chat_file, straight, stop):
    weights, ckpt_dir = straight
    ckpt = torch.load(ckpt_dir / f"step={stop}.ckpt", weights_only=True)
    epoch, batches = divmod(stop, 3)
    saved = {"epoch": epoch if batches else epoch - 1, "batches": batches or 3, "examples": BATCH * (batches or 3)}
    assert ckpt["SFTDataModule"] == {"train_loader": saved}
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [saved]
    resumed = _fit(chat_datamodule(chat_file), ckpt_path=str(ckpt_dir / f"step={stop}.ckpt"))
    assert _max_diff(resumed, weights) == 0.0


def test_resume_when_configure_optimizers_builds_the_loader_first(chat_file, tmp_path):
    """max_epochs set: estimated_stepping_batches builds the train loader before Lightning restores loop
    states (Lightning #20550); the datamodule's own state still puts the loader in place."""
    limits = {"max_steps": -1, "max_epochs": 2}
    weights = _fit(chat_datamodule(chat_file), ckpt_dir=str(tmp_path), save_every=4, **limits)
    resumed = _fit(chat_datamodule(chat_file), ckpt_path=str(tmp_path / "step=4.ckpt"), **limits)
    assert _max_diff(resumed, weights) == 0.0


class _PlainLoaderDataModule(SFTDataModule):
    """The loader before the fix: a shuffled DataLoader with no state (restarts its epoch on resume)."""

    def train_dataloader(self):
        from moe_lab.data.collate import pad_collate

        return DataLoader(ListDataset(self.examples["train"]), batch_size=self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(self.seed),
                          collate_fn=lambda b: pad_collate(b, pad_id=0))


def test_plain_loader_resume_differs(chat_file, tmp_path):
    """Control: without a resumable loader the same check fails (so the test above can fail)."""
    weights = _fit(chat_datamodule(chat_file, _PlainLoaderDataModule), ckpt_dir=str(tmp_path), save_every=4)
    resumed = _fit(chat_datamodule(chat_file, _PlainLoaderDataModule), ckpt_path=str(tmp_path / "step=4.ckpt"))
    assert _max_diff(resumed, weights) > 1e-4


def _batches(loader, n=None):
    return [batch.tolist() for batch in itertools.islice(loader, n)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_state_round_trip_across_epochs(num_workers):
    data = ListDataset(list(range(23)))

    def make():
        return ResumableDataLoader(data, batch_size=5, num_workers=num_workers,
                                   sampler=ResumableSampler(data, shuffle=True, seed=7))

    ref = make()
    epochs = []
    for epoch in range(3):
        ref.sampler.set_epoch(epoch)
        epochs.append(_batches(ref))
    assert epochs[0] != epochs[1] and all(sorted(x for b in e for x in b) == list(range(23)) for e in epochs)
    for epoch, stop in [(0, 2), (1, 4), (2, 1)]:
        first = make()
        first.sampler.set_epoch(epoch)
        assert _batches(first, stop) == epochs[epoch][:stop]
        state = first.state_dict()
        assert state == {"epoch": epoch, "batches": stop, "examples": 5 * stop}
        second = make()
        second.load_state_dict(state)
        assert second.state_dict() == state  # a checkpoint right after resuming keeps the position
        assert _batches(second) == epochs[epoch][stop:]
        assert second.state_dict() == {"epoch": epoch, "batches": 5, "examples": 25}
        second.sampler.set_epoch(epoch + 1)  # the next epoch starts from its beginning
        assert _batches(second) == (epochs[epoch + 1] if epoch + 1 < 3 else _batches(_fresh(make, epoch + 1)))


def _fresh(make, epoch):
    loader = make()
    loader.sampler.set_epoch(epoch)
    return loader


def test_loader_without_resumable_sampler_drops_batches():
    """Iterable datasets have no sampler to skip in: the loader draws and drops the consumed batches."""

    class Counting(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(12))

    loader = ResumableDataLoader(Counting(), batch_size=3)
    assert _batches(loader, 2) == [[0, 1, 2], [3, 4, 5]]
    again = ResumableDataLoader(Counting(), batch_size=3)
    again.load_state_dict(loader.state_dict())
    assert _batches(again) == [[6, 7, 8], [9, 10, 11]]
    assert _batches(again) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]  # next epoch: from the start
    with pytest.raises(ValueError, match="epoch"):
        again.load_state_dict({"batches": 1})


def test_sampler_shards_like_distributed_sampler():
    data = ListDataset(list(range(11)))
    shards = [list(ResumableSampler(data, num_replicas=2, rank=r, seed=3)) for r in range(2)]
    reference = [list(torch.utils.data.DistributedSampler(data, num_replicas=2, rank=r, seed=3)) for r in range(2)]
    assert shards == reference and len(shards[0]) == len(shards[1]) == 6
    assert set(shards[0]) | set(shards[1]) == set(range(11))


def test_position_reaches_the_loader_built_after_another(chat_file):
    """A method may build its own train loader in setup (ESFT scoring) before the checkpoint is restored."""
    dm = chat_datamodule(chat_file)
    dm.setup()
    scoring = dm.train_dataloader()
    _ = next(iter(scoring))
    dm.load_state_dict({"train_loader": {"epoch": 0, "batches": 2}})
    training = dm.train_dataloader()
    reference = chat_datamodule(chat_file)
    reference.setup()
    expected = [x["input_ids"].tolist() for x in reference.train_dataloader()][2:]
    assert [x["input_ids"].tolist() for x in training] == expected


def test_position_is_kept_in_examples_across_a_batch_size_change():
    """Issue 21.8: a resume with another dataset.batch_size (allowed by task.allow_resume_changes) continues after
    the examples already seen, not after as many batches of the new size. Oracle: the sampler's epoch order."""
    data = ListDataset(list(range(24)))

    def make(batch_size):
        return ResumableDataLoader(data, batch_size=batch_size, sampler=ResumableSampler(data, shuffle=True, seed=7))

    order = [x for b in _batches(make(2)) for x in b]
    first = make(2)
    assert len(_batches(first, 3)) == 3
    state = first.state_dict()
    assert state == {"epoch": 0, "batches": 3, "examples": 6}
    for batch_size in (4, 3):  # 6 examples are 1.5 batches of 4: the sampler skips exactly 6 all the same
        second = make(batch_size)
        second.load_state_dict(state)
        assert [x for b in _batches(second) for x in b] == order[6:]

    class Counting(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(12))

    plain = ResumableDataLoader(Counting(), batch_size=3)
    _batches(plain, 2)
    again = ResumableDataLoader(Counting(), batch_size=2)
    again.load_state_dict(plain.state_dict())
    assert _batches(again) == [[6, 7], [8, 9], [10, 11]]
    odd = ResumableDataLoader(Counting(), batch_size=4)
    odd.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match=r"6 examples, .* dataset.batch_size=4"):
        _batches(odd)
