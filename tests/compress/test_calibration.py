"""Calibration statistics against an independent per-token loop over the vanilla HF model (spec 1, 2.15-9)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from moe_lab.compress import Calibration, calibrate
from moe_lab.moe.registry import family_spec
from tests.conftest import build_tiny, random_batch, word_text

EPS32 = torch.finfo(torch.float32).eps


def _hf_moe_inputs(model, batch):
    """Vanilla HF forward; per MoE block: the flattened block input and HF's own (indices, weights), taken by a
    pre-hook on the block's packed-experts module (every v5 family calls experts(x, indices, weights))."""
    block_class = family_spec(model.config.model_type).block_class
    seen, hooks = {}, []
    for name, module in model.named_modules():
        if type(module).__name__ == block_class:
            layer = int(name.split("layers.")[1].split(".")[0])

            def hook(mod, args, layer=layer, block=module):
                seen[layer] = (args[0].detach().clone(), args[1].detach().clone(), args[2].detach().clone(), block)

            hooks.append(module.experts.register_forward_pre_hook(hook))
    model.eval()  # the teacher in inference mode (no jitter, no Gumbel sampling)
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    for h in hooks:
        h.remove()
    return seen


def _expert_out(block, config, e, x):
    """f_e(x) for one token x [H], written from the packed tensors with plain torch."""
    ex = block.experts
    if hasattr(ex, "gate_up_proj_bias"):  # GPT-OSS: interleaved gate/up columns, clamped GLU, biases
        gu = x @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
        limit = config.swiglu_limit
        gate, up = gu[0::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
        return ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ ex.down_proj[e] + ex.down_proj_bias[e]
    I = ex.down_proj.shape[2]
    gu = ex.gate_up_proj[e] @ x
    assert config.hidden_act == "silu"
    return ex.down_proj[e] @ (F.silu(gu[:I]) * gu[I:])


def naive_stats(model, batches):
    """Every section-1 statistic by an explicit loop over real tokens and experts, fp64 sums."""
    config = model.config
    out = {}
    for batch in batches:
        B, S = batch["input_ids"].shape
        mask = batch["attention_mask"].reshape(-1).bool()
        rows = torch.arange(B).repeat_interleave(S)
        for layer, (x, idx, w, block) in _hf_moe_inputs(model, batch).items():
            router = getattr(block, "gate", None) or block.router
            E = router.weight.shape[0]
            st = out.setdefault(layer, {k: torch.zeros(E, dtype=torch.float64) for k in (
                "count", "p_sum", "p_sel", "w_sel", "sq_norm", "wnorm_sel", "norm_sel", "norm_all",
                "seq_act", "seq_mag", "seq_mag_ungated")})
            st.setdefault("gram", torch.zeros(E, E, dtype=torch.float64))
            st.setdefault("out_sum", torch.zeros(E, x.shape[1], dtype=torch.float64))
            st["n"] = st.get("n", 0) + int(mask.sum())
            st["num_seqs"] = st.get("num_seqs", 0) + int((batch["attention_mask"].sum(1) > 0).sum())
            lengths = batch["attention_mask"].sum(1)
            for t in range(x.shape[0]):
                if not mask[t]:
                    continue
                z = x[t].double() @ router.weight.double().T
                if getattr(router, "bias", None) is not None:
                    z = z + router.bias.double()
                p = torch.sigmoid(z) if config.model_type == "deepseek_v3" else torch.softmax(z, -1)
                f = torch.stack([_expert_out(block, config, e, x[t]).double() for e in range(E)])
                norms = f.norm(dim=1)
                inv = 1.0 / float(lengths[rows[t]])
                st["p_sum"] += p
                st["norm_all"] += norms
                st["sq_norm"] += norms**2
                st["gram"] += f @ f.T
                st["out_sum"] += f
                st["seq_mag_ungated"] += norms * inv
                for slot in range(idx.shape[1]):
                    e, we = int(idx[t, slot]), float(w[t, slot])
                    st["count"][e] += 1
                    st["p_sel"][e] += p[e]
                    st["w_sel"][e] += we
                    st["wnorm_sel"][e] += we * norms[e]
                    st["norm_sel"][e] += norms[e]
                    st["seq_act"][e] += inv
                    st["seq_mag"][e] += abs(we) * norms[e] * inv
    return out


def _tol(model):
    """fp32 dot products of length H and I, each a few ulps per term: relative error <= (H + I) eps."""
    c = model.config
    inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    return 4 * (c.hidden_size + inter) * EPS32


def _assert_matches(cal: Calibration, ref: dict, rtol: float):
    assert sorted(cal.layers) == sorted(ref)
    for layer, want in ref.items():
        got = cal.layers[layer]
        assert int(got["n"]) == want["n"] and int(got["num_seqs"]) == want["num_seqs"]
        assert torch.equal(got["count"], want["count"].long()), (layer, got["count"], want["count"])
        for name, value in want.items():
            if name in ("n", "num_seqs", "count"):
                continue
            scale = float(value.abs().max()) + 1e-30
            torch.testing.assert_close(got[name], value, rtol=rtol, atol=rtol * scale, msg=f"{layer}/{name}")


def test_every_statistic_matches_naive_loop(family):
    model = build_tiny(family)
    batches = [random_batch(seed=1), random_batch(batch=2, seq=7, seed=2, pad_rows=((0, 2),))]
    cal = calibrate(model, batches, max_chunk_tokens=5)
    _assert_matches(cal, naive_stats(model, batches), _tol(model))
    m = cal.manifest
    assert m["tokens"] == sum(int(b["attention_mask"].sum()) for b in batches) == int(cal.layers[m["moe_layers"][0]]["n"])
    assert m["num_sequences"] == 5 and m["seq_len"] == 10 and m["complete"]
    spec = family_spec(family)
    for layer, st in cal.layers.items():
        router = getattr(model.model.layers[layer].mlp, spec.router_attr)
        assert torch.equal(st["router_weight"], router.weight.float())
        assert ("router_bias" in st) == (family == "gpt_oss")
        assert ("e_score_correction_bias" in st) == (family == "deepseek_v3")
        assert st["gram"].dtype == torch.float64 and st["count"].dtype == torch.int64
    assert m["p_definition"] == ("sigmoid_scores" if family == "deepseek_v3" else "softmax_all")


def test_chunked_split_and_padding_invariance():
    model = build_tiny("qwen3_moe")
    batch = random_batch(seed=3)
    whole = calibrate(model, [batch], max_chunk_tokens=10_000)
    tol = _tol(model)
    chunked = calibrate(model, [batch], max_chunk_tokens=1)
    tiny_budget = calibrate(model, [batch], memory_budget_mb=1e-3)  # budget forces 1-token chunks too
    rows = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(3)]
    split = calibrate(model, rows)
    repadded = dict(batch, input_ids=batch["input_ids"].clone())
    repadded["input_ids"][batch["attention_mask"] == 0] = 299  # different ids at pad positions
    pads = calibrate(model, [repadded])
    for other in (chunked, tiny_budget, split, pads):
        ref = {layer: {k: (int(v) if v.dim() == 0 else v) for k, v in st.items()} for layer, st in whole.layers.items()}
        _assert_matches(other, ref, tol)


def test_right_padding_adds_nothing():
    """Rows padded on the right (causal attention never sees the pads) == each row alone without padding."""
    model = build_tiny("deepseek_v3")
    batch = random_batch(seed=6, pad_rows=())
    lengths = [10, 7, 5]
    for row, n in enumerate(lengths):
        batch["input_ids"][row, n:] = 0
        batch["attention_mask"][row, n:] = 0
    padded = calibrate(model, [batch])
    alone = calibrate(model, [{"input_ids": batch["input_ids"][r:r + 1, :n],
                               "attention_mask": batch["attention_mask"][r:r + 1, :n]}
                              for r, n in enumerate(lengths)])
    ref = {layer: {k: (int(v) if v.dim() == 0 else v) for k, v in st.items()} for layer, st in alone.layers.items()}
    _assert_matches(padded, ref, _tol(model))
    assert padded.manifest["tokens"] == alone.manifest["tokens"] == 22
    assert padded.manifest["data"]["sha256"] == alone.manifest["data"]["sha256"]


def test_gram_properties():
    cal = calibrate(build_tiny("deepseek_v2"), [random_batch(seed=4)])
    for st in cal.layers.values():
        G = st["gram"] / int(st["n"])
        assert torch.equal(G, G.T)
        assert torch.equal(st["gram"].diagonal(), st["sq_norm"])
        assert float(torch.linalg.eigvalsh(G).min()) >= -1e-10 * float(G.trace())
        v = G.diagonal()
        rho = G / (v[:, None] * v[None, :]).sqrt()
        torch.testing.assert_close(rho.diagonal(), torch.ones_like(v))
        assert float(rho.abs().max()) <= 1 + 1e-12


class _Interrupted(Exception):
    pass


def _stream(batches, stop_after=None):
    for i, b in enumerate(batches):
        if stop_after is not None and i == stop_after:
            raise _Interrupted
        yield b


def test_resume_gives_identical_result(tmp_path):
    model = build_tiny("gpt_oss")
    batches = [random_batch(seed=s) for s in range(5)]
    full = calibrate(model, batches, data_source="unit")
    partial = tmp_path / "partial.safetensors"
    with pytest.raises(_Interrupted):
        calibrate(model, _stream(batches, stop_after=3), partial_path=partial, save_every=2, data_source="unit")
    assert Calibration.load(partial).manifest["batches_done"] == 2
    resumed = calibrate(model, batches, resume_from=partial, partial_path=partial, save_every=2,
                        data_source="unit")
    assert resumed.manifest == full.manifest
    with pytest.raises(ValueError, match="written on other calibration data"):
        calibrate(model, batches[::-1], resume_from=partial)
    for layer, st in full.layers.items():
        for name, value in st.items():
            assert torch.equal(resumed.layers[layer][name], value), (layer, name)


def test_save_load_roundtrip_and_manifest(tmp_path):
    model = build_tiny("qwen2_moe")
    cal = calibrate(model, [random_batch()], data_source="wikitext-103 test blocks")
    path = cal.save(tmp_path / "cal.safetensors")
    back = Calibration.load(path)
    assert back.manifest == cal.manifest
    assert back.manifest["data"]["source"] == "wikitext-103 test blocks"
    assert len(back.manifest["data"]["sha256"]) == 64
    for layer, st in cal.layers.items():
        assert back.layers[layer].keys() == st.keys()
        for name, value in st.items():
            assert torch.equal(back.layers[layer][name], value) and back.layers[layer][name].dtype == value.dtype
    back.check_compatible(model)
    other = calibrate(model, [random_batch(seed=9)])
    assert other.manifest["data"]["sha256"] != cal.manifest["data"]["sha256"]


def test_incompatible_model_is_refused():
    model = build_tiny("qwen3_moe")
    cal = calibrate(model, [random_batch()])
    with pytest.raises(ValueError, match="model_type"):
        cal.check_compatible(build_tiny("olmoe"))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        cal.check_compatible(build_tiny("qwen3_moe", num_hidden_layers=4))
    with pytest.raises(ValueError, match="router weights differ"):
        cal.check_compatible(build_tiny("qwen3_moe", seed=1))
    cal.manifest["revision"] = "abc123"
    with pytest.raises(ValueError, match="revision"):
        cal.check_compatible(model)


def test_missing_and_nonfinite_statistics_are_named():
    cal = calibrate(build_tiny("olmoe"), [random_batch()])
    layer = cal.moe_layers[1]
    del cal.layers[layer]["gram"]
    with pytest.raises(ValueError, match=r"lacks statistic 'gram' \(layer 1\) needed by score do_acp"):
        cal.require("count", "gram", score="do_acp")
    with pytest.raises(ValueError, match="gram.*do_cp"):
        cal.require("gram")
    cal.layers[0]["sq_norm"][5] = math.nan
    with pytest.raises(ValueError, match="'sq_norm' is not finite at layer 0, expert 5"):
        cal.require("sq_norm")
    with pytest.raises(ValueError, match="no batches"):
        calibrate(build_tiny("olmoe"), [])
    from moe_lab.moe.patch import MoEPatch

    patched = build_tiny("olmoe")
    MoEPatch(patched)
    with pytest.raises(ValueError, match="remove the moe-lab patch"):
        calibrate(patched, [random_batch()])


def _compose(tmp_path, *overrides):
    from hydra import compose, initialize_config_dir

    from tests.conftest import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["task=calibrate", f"paths.output_dir={tmp_path}", *overrides])


def test_calibrate_task_on_local_text(tmp_path):
    from moe_lab.models import load_model
    from moe_lab.tasks import run_task

    text = word_text(tmp_path / "wiki.train.txt", 30)
    cfg = _compose(tmp_path, "model=tiny_mixtral", f"compress.calibration.dataset.path={text}",
                   "compress.calibration.num_sequences=5", "compress.calibration.seq_len=16",
                   "compress.calibration.batch_size=2", "compress.calibration.save_every=1")
    assert cfg.compress.calibration.dataset._target_.endswith("TextBlockDataModule")
    summary = run_task(cfg)
    cal = Calibration.load(summary["calibration"])
    assert cal.manifest["tokens"] == 80 and cal.manifest["num_sequences"] == 5 and cal.manifest["seq_len"] == 16
    assert str(text) in cal.manifest["data"]["source"] and cal.manifest["model_config"] == "tiny_mixtral"
    assert not (tmp_path / "calibration.partial.safetensors").exists()
    model, _ = load_model(cfg.model)
    cal.check_compatible(model)
    again = run_task(_compose(tmp_path / "again", "model=tiny_mixtral", f"compress.calibration.dataset.path={text}",
                              "compress.calibration.num_sequences=5", "compress.calibration.seq_len=16"))
    assert Calibration.load(again["calibration"]).manifest["data"] == cal.manifest["data"]
    from moe_lab.tasks.calibrate import calibration_sequences

    sft = _compose(tmp_path / "sft", "model=tiny_mixtral", "dataset@compress.calibration.dataset=synthetic_math",
                   "compress.calibration.num_sequences=5")
    _, tokenizer = load_model(sft.model)
    rows, label = calibration_sequences(sft.compress.calibration.dataset, tokenizer, sft.compress.calibration)
    assert sum(b["input_ids"].shape[0] for b in rows) == 5 and "first 5" in label
    assert all(b["attention_mask"].shape == b["input_ids"].shape for b in rows)
    with pytest.raises(ValueError, match="compress.calibration.num_sequences=500"):
        run_task(_compose(tmp_path / "big", "model=tiny_mixtral", f"compress.calibration.dataset.path={text}",
                          "compress.calibration.num_sequences=500", "compress.calibration.seq_len=16"))


def test_the_same_weights_in_a_lower_precision_are_accepted_with_a_warning(caplog):
    """A float32 calibration of the model the run loads in bf16 (the same weights, rounded) is accepted and says
    so; a bf16 model whose router differs beyond that rounding is still refused."""
    model = build_tiny("qwen3_moe")
    cal = calibrate(model, [random_batch()])
    with caplog.at_level("WARNING", logger="moe_lab.compress.calibration"):
        cal.check_compatible(copy.deepcopy(model).to(torch.bfloat16))
    assert "runs in bfloat16" in caplog.text
    with pytest.raises(ValueError, match="router weights differ"):
        cal.check_compatible(build_tiny("qwen3_moe", seed=1).to(torch.bfloat16))
