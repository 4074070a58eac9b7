"""method=kd's global-token normalisation by the loss: the ResumableDataLoader's window mode (counts, partial
windows, resume positions), the strategy decision and scale factor, DDP against a single-process hand computation,
exact resume."""

from __future__ import annotations

import inspect

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

from moe_lab.data.datamodule import ListDataset
from moe_lab.data.packing import packed_collate
from moe_lab.data.resumable import WINDOW_TOKENS, ResumableDataLoader, ResumableDataModule, ResumableSampler
from moe_lab.distill import kd_loss
from moe_lab.methods.distill import KDModule, loss_scale, normalisation
from tests.conftest import build_tiny

SEQ = 10
#: real tokens per row (left padding): ranks see rows r, r + 2, ...; rank 0 gets the long rows
REAL = [10, 2, 9, 3, 8, 1, 10, 4, 7, 2, 6, 5]


def _rows(real=REAL) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in real:
        ids = torch.randint(3, 300, (SEQ,), generator=gen)
        mask = (torch.arange(SEQ) >= SEQ - n).long()
        rows.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
                     "labels": ids.masked_fill(mask == 0, -100)})
    return rows


# ---- the loader's window mode ---------------------------------------------------------------------------------
def _loader(rows, batch_size=1, shuffle=False):
    data = ListDataset(rows)
    return ResumableDataLoader(data, batch_size=batch_size, sampler=ResumableSampler(data, shuffle=shuffle, seed=3))


def _stamps(batches):
    return [b[WINDOW_TOKENS] for b in batches]


def test_window_counts_with_partial_and_limited_windows():
    rows = _rows(REAL[:7])  # 7 batches: windows of 3 -> [10, 2, 9] [3, 8, 1] [10]
    loader = _loader(rows)
    loader.count_windows(3)
    assert _stamps(loader) == [21] * 3 + [12] * 3 + [10]
    loader.count_windows(3, limit=5)  # Lightning's limit_train_batches cuts the second window
    assert _stamps(loader)[:5] == [21] * 3 + [11] * 2
    big = _loader(rows, batch_size=2)  # a window's count covers every row of its micro-batches
    big.count_windows(2)
    assert _stamps(big) == [24] * 2 + [19] * 2  # batches [10, 2] [9, 3] | [8, 1] [10]
    loader.count_windows(None)
    assert all(WINDOW_TOKENS not in b for b in loader)
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        loader.count_windows(0)


def test_packed_batches_count_their_token_mask():
    rows = [[{"input_ids": [1] * a, "labels": [1] * a}, {"input_ids": [2] * b, "labels": [2] * b}]
            for a, b in ((3, 2), (4, 1), (2, 2))]
    loader = ResumableDataLoader(ListDataset(rows), batch_size=1, collate_fn=lambda x: packed_collate(x, 0))
    loader.count_windows(2)
    assert _stamps(loader) == [10, 10, 4]


def test_read_ahead_is_not_consumed_and_a_resume_mid_window_counts_the_rest():
    rows = _rows(REAL[:10])
    whole = _loader(rows, shuffle=True)
    whole.count_windows(4)
    reference = list(whole)
    tokens = [int(b["attention_mask"].sum()) for b in reference]
    assert _stamps(reference) == [sum(tokens[:4])] * 4 + [sum(tokens[4:8])] * 4 + [sum(tokens[8:])] * 2
    first = _loader(rows, shuffle=True)
    first.count_windows(4)
    it = iter(first)
    for _ in range(5):  # the second window has been read whole, one of its batches handed out
        next(it)
    assert first.state_dict() == {"epoch": 0, "batches": 5, "examples": 5 * first.batch_size}
    second = _loader(rows, shuffle=True)
    second.load_state_dict(first.state_dict())
    second.count_windows(4)
    rest = list(second)
    assert [b["input_ids"].tolist() for b in rest] == [b["input_ids"].tolist() for b in reference[5:]]
    assert _stamps(rest) == [sum(tokens[5:8])] * 3 + [sum(tokens[8:])] * 2  # the resumed window: what is left


def test_batches_without_a_mask_stay_unstamped():
    loader = ResumableDataLoader(ListDataset(list(range(5))), batch_size=2)
    loader.count_windows(2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]


# ---- the strategy decision and the scale factor -----------------------------------------------------------------
def test_decision_and_factor_per_strategy():
    single, ddp = SingleDeviceStrategy("cpu"), DDPStrategy()
    zero2, zero3, fsdp = DeepSpeedStrategy(stage=2), DeepSpeedStrategy(stage=3), FSDPStrategy()
    for strategy in (single, ddp, zero2, zero3, fsdp):
        assert normalisation(strategy, windowed=True) == "loss"
    assert normalisation(single, windowed=False) == normalisation(ddp, windowed=False) == "gradients"
    for strategy in (zero2, zero3, fsdp):
        with pytest.raises(ValueError, match=f"under {type(strategy).__name__}.*ResumableDataLoader"):
            normalisation(strategy, windowed=False)
    # c = what is divided on the way: Lightning's 1/A (all), DeepSpeed's own 1/A again, the mean over W ranks
    assert loss_scale(single, 3, 1) == 3.0
    assert loss_scale(ddp, 3, 4) == loss_scale(fsdp, 3, 4) == 12.0
    assert loss_scale(zero3, 3, 4) == 36.0
    zero2.config["gradient_accumulation_steps"] = 3  # what Lightning writes at setup
    assert loss_scale(zero2, 3, 4) == 36.0
    # moe-lab's DeepSpeed strategies (build_strategy) turn DeepSpeed's second division off
    from moe_lab.runtime.strategies import build_strategy

    ours = build_strategy({"strategy": {"_target_": "lightning.pytorch.strategies.DeepSpeedStrategy", "stage": 3},
                           "accelerator": "cpu", "devices": 1, "precision": "bf16-mixed"})
    assert loss_scale(ours, 3, 4) == 12.0


def test_the_divisions_the_factor_cancels_are_the_installed_ones():
    """Tripwire on the library code ``loss_scale`` mirrors: Lightning divides training_step's loss by
    accumulate_grad_batches, DeepSpeed's engine.backward divides by its gradient_accumulation_steps by default and
    Lightning's DeepSpeed precision plugin does not turn that off."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from lightning.pytorch.loops.optimization.automatic import ClosureResult
    from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision

    assert float(ClosureResult.from_training_step_output(torch.tensor(6.0), 3).loss) == 2.0
    backward = inspect.getclosurevars(DeepSpeedEngine.backward).nonlocals["func"]  # under an NVTX decorator
    assert inspect.signature(backward).parameters["scale_wrt_gas"].default is True
    assert "loss = loss / self.gradient_accumulation_steps() if scale_wrt_gas" in inspect.getsource(backward)
    assert "deepspeed_engine.backward(tensor, *args, **kwargs)" in inspect.getsource(DeepSpeedPrecision.backward)


def test_deepspeed_refuses_an_epoch_of_partial_windows():
    from types import SimpleNamespace

    module = _module()
    loader = _loader(_rows(REAL[:5]))
    module._trainer = SimpleNamespace(strategy=DeepSpeedStrategy(stage=3), train_dataloader=loader,
                                      accumulate_grad_batches=2, num_training_batches=5)
    with pytest.raises(ValueError, match=r"5 batches.*accumulate_grad_batches=2.*limit_train_batches.*\(e.g. 4\)"):
        module.on_train_start()
    module._trainer.num_training_batches = 4
    module._count_windows()
    assert loader._window == (2, 4)


def test_window_checks_at_the_window_end():
    """The loader's count must match the tokens the window's micro-batches held; under DeepSpeed the engine's
    accumulation boundary must be Lightning's window end (fakes: no engine runs on CPU)."""
    from types import SimpleNamespace

    module = _module()
    module.log = lambda *args, **kwargs: None
    boundary = [True]
    strategy = SimpleNamespace(deepspeed_engine=SimpleNamespace(is_gradient_accumulation_boundary=lambda: boundary[0]),
                               reduce=lambda tensor, reduce_op: tensor)
    module._trainer = SimpleNamespace(strategy=strategy, fit_loop=SimpleNamespace(_should_accumulate=lambda: False),
                                      global_step=4)

    def window_end(announced, seen=12):
        module.normalised_by, module._global_window = "loss", announced
        module._window_sum, module._window_tokens = 3.0, seen
        module.on_after_backward()

    window_end(12)
    assert module.last_finite_loss == 0.25
    with pytest.raises(RuntimeError, match="announced 13 real tokens .* optimizer step 5, the micro-batches held 12"):
        window_end(13)
    boundary[0] = False
    with pytest.raises(RuntimeError, match="DeepSpeed's accumulation window is out of step"):
        window_end(12)


# ---- Lightning runs ---------------------------------------------------------------------------------------------
class _SGDKD(KDModule):
    """KDModule with plain SGD, so a step is ``w - lr * grad`` (the oracle applies it by hand)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.optim["lr"])


def _module(lr=1.0, cls=KDModule):
    return cls(build_tiny("qwen3_moe", seed=1), teacher=build_tiny("qwen3_moe", seed=0),
               options={"chunk_size": 7}, optim={"lr": lr})


class _Rows(ResumableDataModule):
    """This rank's share of ``rows`` (``ResumableSampler``), as moe-lab's datamodules build it."""

    def __init__(self, rows, batch_size=1, shuffle=False):
        super().__init__()
        self.rows, self.batch_size, self.shuffle = rows, batch_size, shuffle

    def train_dataloader(self):
        replicas, rank = self.data_parallel_shard()
        data = ListDataset(self.rows)
        sampler = ResumableSampler(data, num_replicas=replicas, rank=rank, shuffle=self.shuffle, seed=5)
        return self.track_train_loader(ResumableDataLoader(data, batch_size=self.batch_size, sampler=sampler))


def _stack(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _hand_steps(rows, steps, lr):
    """The oracle: SGD where each step's gradient is the mean over its groups of rows of the gradient of (sum over
    the group's tokens of forward KL) / (the group's token count), each group one batch, by autograd through
    kd_loss on the full HF logits (no chunking, no accumulation, no ranks)."""
    torch.manual_seed(0)
    module = _module(lr)
    model, teacher = module.model, module.teacher
    params = [p for p in model.parameters() if p.requires_grad]
    scale = []
    for groups in steps:
        total, count = [torch.zeros_like(p) for p in params], 0
        for group in groups:
            batch = _stack([rows[i] for i in group])
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            with torch.no_grad():
                t_logits = teacher(**inputs).logits
            tokens = int(batch["attention_mask"].sum())
            count += tokens
            loss = kd_loss(model(**inputs).logits, t_logits, kind="forward_kl", mask=batch["attention_mask"],
                           normalizer=tokens)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for t, g in zip(total, grads):
                if g is not None:
                    t.add_(g / len(groups))
        scale.append((count, max(float(t.abs().max()) for t in total)))
        with torch.no_grad():
            for p, g in zip(params, total):
                p.sub_(lr * g)
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}, scale


@pytest.mark.slow
def test_ddp_two_ranks_equal_the_hand_computation_over_all_tokens(tmp_path):
    """2 gloo ranks, 5 micro-batches of 1 row each, accumulate 2: windows of batches [0, 1], [2, 3] and the
    partial [4]; rank 0 holds long rows, rank 1 short ones, so per-rank normalisation would differ."""
    rows, lr = _rows(REAL[:10]), 0.5
    torch.manual_seed(0)
    module = _module(lr, _SGDKD)
    start = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=3, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=_Rows(rows))
    got = {k: v.detach() for k, v in module.model.state_dict().items()}
    # global window w = micro-batches 2w, 2w + 1 of both ranks; rank r's micro-batch i is row r + 2i
    windows = [[r + 2 * i for i in micro for r in (0, 1)] for micro in ([0, 1], [2, 3], [4])]
    want, scale = _hand_steps(rows, [[w] for w in windows], lr)
    # per step each gradient entry is a sum over the window's N tokens in another order (micro-batches, ranks,
    # chunks, the analytic vs autograd KL gradient): <= N * eps of the largest entry, x 8 margin, times lr
    eps = torch.finfo(torch.float32).eps
    tol = lr * sum(8 * n * eps * g for n, g in scale)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    assert diff <= tol, (diff, tol)
    assert moved > 1000 * tol
    # what the test tells apart: each rank normalising by its own tokens, then DDP's mean over the ranks
    per_rank = [[[r + 2 * i for i in micro] for r in (0, 1)] for micro in ([0, 1], [2, 3], [4])]
    wrong = _hand_steps(rows, per_rank, lr)[0]
    assert max(float((got[k] - wrong[k]).abs().max()) for k in want) > 100 * tol


def _fit(rows, ckpt_dir=None, ckpt_path=None, max_steps=5):
    L.seed_everything(0)
    module = _module(1e-2)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1)] \
        if ckpt_dir else []
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
                        max_steps=max_steps, accumulate_grad_batches=2, default_root_dir=ckpt_dir)
    trainer.fit(module, datamodule=_Rows(rows, batch_size=2, shuffle=True), ckpt_path=ckpt_path)
    assert trainer.global_step == max_steps and module.normalised_by == "loss"
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_resume_in_window_mode_equals_the_uninterrupted_run(tmp_path):
    """10 shuffled rows, 2 per micro-batch, accumulate 2: 5 micro-batches = windows 2, 2, 1 per epoch, 3 steps;
    5 steps cross into the second epoch. Resumed after step 1 (mid-epoch) and step 3 (after the partial window)."""
    rows = _rows(REAL[:10])
    straight = _fit(rows, ckpt_dir=str(tmp_path))
    for stop, position in ((1, {"epoch": 0, "batches": 2, "examples": 4}), (3, {"epoch": 0, "batches": 5, "examples": 10})):
        ckpt = tmp_path / f"step={stop}.ckpt"
        assert torch.load(ckpt, weights_only=True)["_Rows"] == {"train_loader": position}
        resumed = _fit(rows, ckpt_path=str(ckpt))
        assert all(torch.equal(resumed[k], straight[k]) for k in straight), stop


class _SaveAt(L.Callback):
    """Writes a checkpoint after micro-batch ``batch_idx`` (mid-window), as CheckpointOnSignal does after the
    micro-batch during which a signal arrived; records each batch's announced and own real tokens."""

    def __init__(self, path=None, batch_idx=None):
        self.path, self.batch_idx, self.seen = path, batch_idx, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((batch_idx, batch[WINDOW_TOKENS], int(batch["attention_mask"].sum())))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


def test_a_mid_window_checkpoint_saves_the_consumed_position(tmp_path):
    """Saved after micro-batch 2 of 5 (the first of window [2, 3]): the loader has read batch 3 ahead but the
    position is 3 batches; the resumed run's first window is what is left of it ([3]), then the partial [4]."""
    rows, ckpt = _rows(REAL[:10]), tmp_path / "mid.ckpt"

    def fit(callback, ckpt_path=None):
        L.seed_everything(0)
        module = _module(1e-2)
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, callbacks=[callback],
                            max_steps=3, accumulate_grad_batches=2, default_root_dir=tmp_path)
        trainer.fit(module, datamodule=_Rows(rows, batch_size=2, shuffle=True), ckpt_path=ckpt_path)
        assert trainer.global_step == 3 and module.normalised_by == "loss"

    first = _SaveAt(ckpt, batch_idx=2)
    fit(first)
    own = [n for _, _, n in first.seen]
    assert [w for _, w, _ in first.seen] == [own[0] + own[1]] * 2 + [own[2] + own[3]] * 2 + [own[4]]
    assert torch.load(ckpt, weights_only=True)["_Rows"] == {"train_loader": {"epoch": 0, "batches": 3,
                                                                                   "examples": 6}}
    resumed = _SaveAt()
    fit(resumed, ckpt_path=str(ckpt))
    assert resumed.seen == [(3, own[3], own[3]), (4, own[4], own[4])]
