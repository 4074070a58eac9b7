"""method=kd: the Lightning objective against independent computations (HF logits + kd_loss), global-batch
normalisation under gradient accumulation, NaN stop, bad pairs named."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from moe_lab.data.resumable import ResumableDataLoader
from moe_lab.distill import kd_loss
from moe_lab.methods.distill import KDModule
from tests.conftest import build_tiny, random_batch


def _rows(batch):
    return [{k: v[i] for k, v in batch.items()} for i in range(batch["input_ids"].shape[0])]


def _loader(batch, batch_size, cls=DataLoader):
    return cls(_rows(batch), batch_size=batch_size, shuffle=False)


def _trainer(**kw):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


class _GradGrab(L.Callback):
    def __init__(self):
        self.grads = None

    def on_train_start(self, trainer, pl_module):
        def grab(opt, args, kwargs):
            if self.grads is None:
                self.grads = {n: p.grad.clone() for n, p in pl_module.model.named_parameters() if p.grad is not None}
        trainer.optimizers[0].register_step_post_hook(grab)  # the closure (backward) runs inside step


def _module(**options):
    return KDModule(build_tiny("qwen3_moe", seed=1), teacher=build_tiny("qwen3_moe", seed=0),
                    options={"chunk_size": 7, **options}, optim={"lr": 1e-3})


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_token_sums_match_hf_logits(loss):
    module = _module(loss=loss, temperature=2.0)
    batch = random_batch()
    sums = module.kd_sums(batch)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        ref = kd_loss(module.model(**inputs).logits, module.teacher(**inputs).logits, kind=loss, temperature=2.0,
                      mask=batch["attention_mask"], normalizer=1.0)
    # sums of 22 per-token fp32 values ~1: 22 * 1.2e-7 plus the two paths' matmul rounding
    assert torch.allclose(sums["div"], ref, rtol=1e-5, atol=1e-5)
    assert int(sums["tokens"]) == int(batch["attention_mask"].sum())


@pytest.mark.parametrize(("cls", "path"), [(ResumableDataLoader, "loss"), (DataLoader, "gradients")],
                         ids=["window_count", "plain_loader"])
def test_accumulation_2x1_equals_1x2_with_unequal_token_counts(cls, path):
    """A ResumableDataLoader's window count scales the loss before backward; a plain DataLoader falls back to
    scaling the gradients after the window's last backward. Both give the same step."""
    batch = random_batch(batch=2, seq=10, pad_rows=((1, 6),))  # 10 and 4 real tokens
    grads = []
    for micro, accumulate in ((2, 1), (1, 2)):
        torch.manual_seed(0)
        module = _module()
        grab = _GradGrab()
        _trainer(max_steps=1, accumulate_grad_batches=accumulate, callbacks=[grab]).fit(
            module, train_dataloaders=_loader(batch, micro, cls))
        assert module.normalised_by == path
        grads.append(grab.grads)
    # one large batch, computed by hand: d/dtheta of (sum of per-token KL) / 14
    module = _module()
    module.kd_sums(batch)["loss"].div(14).backward()
    hand = {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}
    assert set(grads[0]) == set(grads[1]) == set(hand)
    for name, ref in hand.items():
        # fp32 sums over <= 14 tokens reordered: relative error ~ 14 * 1.2e-7 of the largest entry, x 5 margin
        scale = ref.abs().max().item() + 1e-12
        assert torch.allclose(grads[0][name], ref, rtol=0, atol=1e-5 * scale), name
        assert torch.allclose(grads[1][name], ref, rtol=0, atol=1e-5 * scale), name


def test_nan_stops_with_step_and_last_finite_loss():
    class Poison(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                with torch.no_grad():
                    pl_module.model.lm_head.weight.fill_(float("nan"))

    module = _module()
    with pytest.raises(FloatingPointError, match=r"at optimizer step 2; last finite loss \d"):
        _trainer(max_steps=3, callbacks=[Poison()]).fit(module, train_dataloaders=_loader(random_batch(), 1))
    assert module.last_finite_loss is not None


def test_bad_pairs_are_named():
    with pytest.raises(ValueError, match="student vocabulary 384 != teacher vocabulary 400"):
        KDModule(build_tiny("qwen3_moe"), teacher=build_tiny("qwen3_moe", vocab_size=400))
    with pytest.raises(ValueError, match="student hidden size 64 / 3 layers vs teacher 64 / 4 layers"):
        KDModule(build_tiny("qwen3_moe"), teacher=build_tiny("qwen3_moe", num_hidden_layers=4),
                 options={"loss": "fkl_hidden"})
    with pytest.raises(ValueError, match="method.teacher is not set"):
        KDModule(build_tiny("qwen3_moe"))
    with pytest.raises(TypeError, match="unknown option"):
        KDModule(build_tiny("qwen3_moe"), teacher=build_tiny("qwen3_moe"), options={"tau": 2})


def test_hidden_mse_term_and_identical_student_is_zero():
    teacher = build_tiny("qwen3_moe", seed=0)
    module = KDModule(build_tiny("qwen3_moe", seed=0), teacher=teacher, options={"loss": "fkl_hidden"})
    sums = module.kd_sums(random_batch())
    assert float(sums["div"]) == pytest.approx(0, abs=1e-5) and float(sums["hidden"]) == pytest.approx(0, abs=1e-8)
    other = KDModule(build_tiny("qwen3_moe", seed=1), teacher=teacher,
                     options={"loss": "fkl_hidden", "hidden_norm": "layer_mean"})
    sums = other.kd_sums(random_batch())
    assert float(sums["hidden"]) > 0 and torch.allclose(sums["loss"], sums["div"] + sums["hidden"])


def test_hidden_mse_normalisations_against_hand_layer_states():
    """fkl_hidden's hidden term against a float64 hand computation from HF's ``output_hidden_states`` (the
    residual stream after each decoder layer; HF's last entry is post-norm, so the last layer's output is read
    at the final norm's input): layer_sum = sum over layers of the per-token MSE, layer_mean = that / L,
    balanced = the layer mean rescaled to the KD term's value, each with its effective weight recorded."""
    teacher = build_tiny("qwen3_moe", seed=0)
    student = build_tiny("qwen3_moe", seed=1)
    batch = random_batch()
    mask = batch["attention_mask"].bool()

    def states(model):
        seen = []
        handle = model.model.norm.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        output_hidden_states=True)
        handle.remove()
        return list(out.hidden_states[1:-1]) + seen

    L = student.config.num_hidden_layers
    pairs = list(zip(states(student), states(teacher)))
    assert len(pairs) == L
    hand = float(sum(((a.double() - b.double()) ** 2).mean(-1)[mask].sum() for a, b in pairs))
    results = {}
    for norm in ("layer_sum", "layer_mean", "balanced"):
        module = KDModule(build_tiny("qwen3_moe", seed=1), teacher=teacher,
                          options={"loss": "fkl_hidden", "hidden_norm": norm, "hidden_weight": 0.5})
        results[norm] = sums = module.kd_sums(batch)
        module._step(batch, "val")
        assert module.kd_stats["hidden_weight"] == pytest.approx(float(sums["hidden_weight"]))
    assert float(results["layer_sum"]["hidden"]) == pytest.approx(hand, rel=1e-5)
    assert float(results["layer_mean"]["hidden"]) == pytest.approx(hand / L, rel=1e-5)
    assert float(results["layer_mean"]["hidden_weight"]) == 0.5
    bal = results["balanced"]
    div, mse = float(bal["div"]), float(bal["hidden"])
    assert float(bal["hidden_weight"]) == pytest.approx(0.5 * div / mse, rel=1e-6)
    assert float(bal["loss"]) == pytest.approx(1.5 * div, rel=1e-5)  # the hidden term = 0.5 x the KD term
    with pytest.raises(ValueError, match="hidden_norm='sum': choose one of balanced, layer_mean, layer_sum"):
        KDModule(build_tiny("qwen3_moe"), teacher=teacher, options={"loss": "fkl_hidden", "hidden_norm": "sum"})
