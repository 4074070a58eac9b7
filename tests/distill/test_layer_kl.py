"""Logit-lens KL per layer-group (kd/kl_group_<i>) against a float64 hand computation from HF hidden states."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from moe_lab.callbacks.kd import KDLayerKL, KDMetrics
from moe_lab.distill.layer_kl import group_ends, layer_group_kl
from tests.conftest import build_tiny, random_batch


def _hand(student, teacher, batch, ends):
    """Forward KL(p_T || p_S) in float64 at each group end: HF ``hidden_states[e + 1]`` (output of layer e)
    through the final norm and lm_head, the last group the models' own logits; mean over real tokens."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        out_s, out_t = student(**inputs, output_hidden_states=True), teacher(**inputs, output_hidden_states=True)
        values = []
        for e in ends:
            if e == len(student.model.layers) - 1:
                zs, zt = out_s.logits, out_t.logits
            else:
                zs = student.lm_head(student.model.norm(out_s.hidden_states[e + 1]))
                zt = teacher.lm_head(teacher.model.norm(out_t.hidden_states[e + 1]))
            ls, lt = torch.log_softmax(zs[mask].double(), -1), torch.log_softmax(zt[mask].double(), -1)
            values.append(float((lt.exp() * (lt - ls)).sum(-1).mean()))
    return values


def test_group_ends():
    assert group_ends(24, 4) == [5, 11, 17, 23] and group_ends(3, 4) == [0, 1, 2] and group_ends(5, 2) == [1, 4]
    with pytest.raises(ValueError, match="layer_groups=0"):
        group_ends(4, 0)


@pytest.mark.parametrize("groups, chunk", [(4, 7), (2, None)])
def test_matches_hand_computation(groups, chunk):
    teacher, student = build_tiny("qwen3_moe", seed=0).eval(), build_tiny("qwen3_moe", seed=1).eval()
    batch = random_batch(seed=3)
    ends = group_ends(3, groups)
    got = layer_group_kl(student, teacher, {k: batch[k] for k in ("input_ids", "attention_mask")},
                         batch["attention_mask"], groups, chunk)
    ref = _hand(student, teacher, batch, ends)
    assert len(got) == len(ends) and min(ref) > 0.01
    for g, r in zip(got, ref):  # fp32 log-softmax over 384 logits of ~O(10) vs float64: a few 1e-6 relative
        assert abs(g - r) <= 1e-5 * max(1.0, abs(r)), (got, ref)
    same = layer_group_kl(teacher, teacher, {k: batch[k] for k in ("input_ids", "attention_mask")}, None, groups)
    assert all(v == 0.0 for v in same)


class _Toy(L.LightningModule):
    """Just what the callback reads of a KDModule: ``model``, ``teacher``, ``kd_stats``."""

    def __init__(self, student, teacher):
        super().__init__()
        self.model, self._t, self.kd_stats = student, [teacher], {}

    @property
    def teacher(self):
        return self._t[0]

    def training_step(self, batch, idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.0)


def _fit(tmp_path, student, teacher, callbacks):
    batch = {k: v for k, v in random_batch(seed=3).items()}
    loader = torch.utils.data.DataLoader([batch] * 3, batch_size=None)
    trainer = L.Trainer(max_steps=3, logger=CSVLogger(str(tmp_path)), callbacks=callbacks, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(_Toy(student, teacher), loader)
    return trainer, batch


def test_callback_logs_every_n_steps(tmp_path, caplog):
    teacher, student = build_tiny("qwen3_moe", seed=0).eval(), build_tiny("qwen3_moe", seed=1)
    cb = KDLayerKL(layer_groups=3, every_n_steps=2)
    trainer, batch = _fit(tmp_path, student, teacher, [cb, KDMetrics()])
    assert trainer.callbacks[-1].layer_kl is None  # the configured KDLayerKL wins over KDMetrics' default
    ref = _hand(student.eval(), teacher, batch, [0, 1, 2])  # lr 0: the student never changes
    for i, r in enumerate(ref):
        assert abs(float(trainer.callback_metrics[f"kd/kl_group_{i}"]) - r) <= 1e-5 * max(1.0, r)
    lines = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    logged = [row for row in lines[1:] if row.split(",")[lines[0].split(",").index("kd/kl_group_0")]]
    assert len(logged) == 1  # steps 1..3 with every_n_steps=2: step 2 only
    with caplog.at_level(logging.INFO, logger="moe_lab.callbacks.kd"):
        trainer, _ = _fit(tmp_path / "b", build_tiny("qwen3_moe", seed=1, num_hidden_layers=2), teacher,
                          [KDLayerKL(layer_groups=2, every_n_steps=1)])
    assert not any(k.startswith("kd/kl_group") for k in trainer.callback_metrics)
    assert sum("student has 2 decoder layers, teacher 3" in r.message for r in caplog.records) == 1
    default = KDMetrics()
    default.setup(type("T", (), {"callbacks": [default]})(), None, "fit")
    assert (default.layer_kl.layer_groups, default.layer_kl.every_n_steps) == (4, 50)
