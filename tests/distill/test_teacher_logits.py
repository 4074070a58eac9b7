"""KD from a precomputed teacher record == KD from the live teacher (full: exact; top-k: the truncated sum)."""

from __future__ import annotations

import pytest
import torch

from moe_lab.distill import kd_loss
from moe_lab.distill import teacher_logits as tl
from tests.conftest import build_tiny, random_batch


def test_record_matches_live_teacher(tmp_path):
    teacher, student = build_tiny("qwen3_moe", seed=0).eval(), build_tiny("qwen3_moe", seed=1).eval()
    batches = [{k: random_batch(seed=s)[k] for k in ("input_ids", "attention_mask")} for s in (0, 1)]
    full, top = tl.record_teacher(teacher, batches), tl.record_teacher(teacher, batches, top_k=8)
    tl.save(full, tmp_path / "full.safetensors")
    tl.save(top, tmp_path / "top.safetensors")
    full, top = tl.load(tmp_path / "full.safetensors"), tl.load(tmp_path / "top.safetensors")
    offset = 0
    with torch.no_grad():
        for batch in batches:
            mask = batch["attention_mask"]
            n = int(mask.sum())
            s_logits, t_logits = student(**batch).logits, teacher(**batch).logits
            part = {k: v[offset:offset + n] for k, v in full.items()}
            for kind in ("forward_kl", "reverse_kl", "jsd"):
                live = kd_loss(s_logits, t_logits, kind=kind, mask=mask)
                assert torch.equal(tl.kd_loss_from_record(s_logits, part, kind=kind, mask=mask), live)
            # top-k: the truncated forward-KL sum, written out independently in float64
            ls = torch.log_softmax(s_logits.double(), -1)[mask.bool()]
            lt = torch.log_softmax(t_logits.double(), -1)[mask.bool()]
            idx = lt.topk(8, dim=-1).indices
            ref = (lt.gather(1, idx).exp() * (lt.gather(1, idx) - ls.gather(1, idx))).sum(-1).mean()
            got = tl.kd_loss_from_record(s_logits, {k: v[offset:offset + n] for k, v in top.items()}, mask=mask)
            assert abs(float(got) - float(ref)) < 1e-5
            offset += n
    with pytest.raises(ValueError, match="forward_kl at temperature 1 only"):
        tl.kd_loss_from_record(s_logits, top, kind="reverse_kl")
    with pytest.raises(ValueError, match="top_k=0"):
        tl.record_teacher(teacher, batches, top_k=0)


def test_full_vocabulary_top_k_is_exact():
    teacher, student = build_tiny("qwen3_moe", seed=0).eval(), build_tiny("qwen3_moe", seed=1).eval()
    batch = {k: random_batch()[k] for k in ("input_ids", "attention_mask")}
    record = tl.record_teacher(teacher, [batch], top_k=teacher.config.vocab_size)
    with torch.no_grad():
        s, t = student(**batch).logits, teacher(**batch).logits
    live = kd_loss(s, t, mask=batch["attention_mask"])
    assert abs(float(tl.kd_loss_from_record(s, record, mask=batch["attention_mask"])) - float(live)) < 1e-6


def test_module_with_record_equals_live_teacher(tmp_path):
    from moe_lab.methods.distill import KDModule

    teacher = build_tiny("qwen3_moe", seed=0).eval()
    batches = [random_batch(seed=s) for s in (0, 1)]
    path = tmp_path / "t.safetensors"
    tl.save_run(tl.record_run(teacher, [[{k: b[k] for k in ("input_ids", "attention_mask")} for b in batches]]),
                path, world_size=1)
    live = KDModule(build_tiny("qwen3_moe", seed=1).eval(), teacher=teacher)
    recorded = KDModule(build_tiny("qwen3_moe", seed=1).eval(), options={"teacher_logits": str(path)})
    for batch in batches:
        a, b = live.kd_sums(batch), recorded.kd_sums(batch)
        # token sums of ~20 fp32 terms: chunked-head vs full-logit paths differ by rounding only
        assert torch.allclose(a["div"], b["div"], rtol=1e-5, atol=1e-5) and int(a["tokens"]) == int(b["tokens"])
    with pytest.raises(ValueError, match="holds 2 train batches for rank 0; the run reads batch 3"):
        recorded.kd_sums(batches[0])
    with pytest.raises(ValueError, match="logit loss only"):
        KDModule(build_tiny("qwen3_moe"), options={"teacher_logits": str(path), "loss": "fkl_hidden"})
    tl.save(tl.record_teacher(teacher, [{k: batches[0][k] for k in ("input_ids", "attention_mask")}]),
            tmp_path / "old.safetensors")
    with pytest.raises(ValueError, match="not a run record with batch checksums.*task=teacher_logits"):
        KDModule(build_tiny("qwen3_moe"), options={"teacher_logits": str(tmp_path / "old.safetensors")})
