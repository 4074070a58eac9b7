"""Calibration statistics against an independent per-token loop over the vanilla HF model (spec 1, 2.15-9)."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F

from moe_lab.compress import Calibration, calibrate
from moe_lab.moe.registry import family_spec
from tests.conftest import build_tiny, hf_router_output, random_batch, word_text

EPS32 = torch.finfo(torch.float32).eps


def _at(root, path: str):
    """The attribute at the dotted ``path`` below ``root`` (None where a part is absent)."""
    for part in path.split("."):
        root = getattr(root, part, None)
    return root


def _moe_blocks(model) -> dict:
    """{decoder layer: HF sparse-MoE block} (the registry's block class, the only family fact used here)."""
    block_class = family_spec(model.config.model_type).block_class
    return {int(re.search(r"(?:layers|blocks)\.(\d+)\.", name).group(1)): module  # DBRX: transformer.blocks.<i>
            for name, module in model.named_modules() if type(module).__name__ == block_class}


def _hf_moe_inputs(model, batch):
    """Vanilla HF forward; per MoE layer: the flattened block input ``x``, HF's router logits ``z`` (the first
    output of the block's router module: every v5 router returns (logits, weights, indices), GPT-OSS's bias and
    Laguna's soft-cap included) and HF's own ``idx`` / ``w``, taken by a pre-hook on the packed-experts module
    (every v5 family calls experts(x, indices, weights)). Where the routing weight scales the expert input
    (registry ``weight_on_input``: Llama 4, whose experts get the weight-scaled copies and whose router returns
    (scores, logits)), ``x`` is the block input and ``idx`` / ``w`` the top-k of HF's router scores."""
    spec = family_spec(model.config.model_type)
    seen, hooks = {}, []
    for layer, block in _moe_blocks(model).items():
        entry = seen[layer] = {"block": block}

        def experts_hook(mod, args, entry=entry):
            x = args[0].detach().reshape(-1, args[0].shape[-1])  # DBRX passes [B, S, H]
            entry.update(x=x.clone(), idx=args[1].detach().clone(), w=args[2].detach().clone())

        def block_hook(mod, args, entry=entry):
            entry["x"] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()

        def router_hook(mod, args, out, entry=entry):
            if isinstance(out, torch.Tensor):  # DBRX's router returns the logits alone
                out = (out, None, None)
            z, w, idx = hf_router_output(spec, mod, out)
            entry["z"] = z.detach().reshape(-1, z.shape[-1]).clone()
            if spec.weight_on_input:
                entry.update(idx=idx.detach().clone(), w=w.detach().clone())

        router = _at(block, spec.router_attr)
        hooks += [block.register_forward_pre_hook(block_hook) if spec.weight_on_input
                  else block.experts.register_forward_pre_hook(experts_hook),
                  router.register_forward_hook(router_hook)]
    model.eval()  # the teacher in inference mode (no jitter, no Gumbel sampling)
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    for h in hooks:
        h.remove()
    for entry in seen.values():
        assert entry["z"].shape[0] == entry["x"].shape[0] == entry["idx"].shape[0]
    return seen


def hf_score_function(z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> str:
    """The per-expert score HF's router weighs its chosen experts by, read from HF's own outputs: ``"sigmoid"``
    when, token by token, HF's top-k weights are proportional to sigmoid(z) on the chosen experts (an elementwise
    sigmoid router, whatever its renormalisation, routed scaling or selection-only bias), else ``"softmax"``
    (softmax top-k, softmax over the top-k, sparsemixer): the paper's p, a softmax over all E logits. Sigmoid is
    accepted only where softmax does not fit. A fit holds to ~1e-7 (fp32 weights), a misfit is off by > 0.3 on the
    tiny models: 1e-4 separates them. p of a sigmoid router = its sigmoid affinities (spec 2.2; moe-lab's manifest
    p_definition "sigmoid_scores"): no selection-only bias, renormalisation or routed scaling. A top-1 router's
    one weight per token fits any score: there the ratio must be one constant over all tokens."""
    def proportional(score):
        r = w.double() / score.gather(1, idx)
        r = r.reshape(1, -1) if idx.shape[1] == 1 else r
        return bool(((r.max(1).values - r.min(1).values) <= 1e-4 * r.abs().max(1).values).all())

    sigmoid, softmax = proportional(z.double().sigmoid()), proportional(z.double().softmax(-1))
    assert not (sigmoid and softmax), "HF's weights fit both a sigmoid and a softmax router: draw other weights"
    return "sigmoid" if sigmoid else "softmax"


def _hf_expert_outputs(block64, x: torch.Tensor, spec) -> torch.Tensor:
    """f_e(x_t) [T, E, H] float64 for tokens ``x`` [T, H]: HF's own experts module (its eager code) of a float64
    copy of the block, each token sent to each expert e alone with weight 1 (one row per (token, expert) pair)."""
    T, H = x.shape
    E = block64.experts.num_experts
    ones = torch.ones(T * E, 1, dtype=torch.float64)
    with torch.no_grad():
        if spec.weight_on_input:  # HF's dense bmm: every expert on its own copy of the tokens, weight 1
            return block64.experts(x.double().repeat(E, 1)).reshape(E, T, H).transpose(0, 1)
        out = block64.experts(x.double().repeat_interleave(E, dim=0), torch.arange(E).repeat(T)[:, None], ones)
    return out.reshape(T, E, H)


def _handwritten_applies(spec, config) -> bool:
    """The hand-written SwiGLU / GPT-OSS path below describes the family's experts (the registry says so)."""
    if spec.expert_layout == "w1_v1_w2":
        return config.ffn_config.ffn_act_fn.get("name") == "silu"
    return spec.expert_layout == "gpt_oss" or (
        spec.expert_act == "act_fn" and getattr(config, "hidden_act", None) == "silu")


def _expert_out(block, config, e, x):
    """f_e(x) for one token x [H], written from the packed tensors with plain torch (a cross-check of HF's)."""
    ex = block.experts
    if hasattr(ex, "gate_up_proj_bias"):  # GPT-OSS: interleaved gate/up columns, clamped GLU, biases
        gu = x @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
        limit = config.swiglu_limit
        gate, up = gu[0::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
        return ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ ex.down_proj[e] + ex.down_proj_bias[e]
    if family_spec(config.model_type).expert_layout == "transposed":  # [H, 2I] gate then up columns, [I, H] down
        gate, up = (x @ ex.gate_up_proj[e]).chunk(2)
        return (F.silu(gate) * up) @ ex.down_proj[e]
    if hasattr(ex, "mlp"):  # DBRX: expert e owns rows e*I .. (e+1)*I-1 of w1 (gate), v1 (up) and w2 (down, [I, H])
        rows = slice(e * ex.ffn_hidden_size, (e + 1) * ex.ffn_hidden_size)
        w1, v1, w2 = ex.mlp.w1[rows], ex.mlp.v1[rows], ex.mlp.w2[rows]
        return (F.silu(w1 @ x) * (v1 @ x)) @ w2
    I = ex.down_proj.shape[2]
    gu = ex.gate_up_proj[e] @ x
    return ex.down_proj[e] @ (F.silu(gu[:I]) * gu[I:])


def naive_stats(model, batches):
    """Every section-1 statistic by an explicit loop over real tokens and experts, fp64 sums, from vanilla HF only:
    f_e from HF's experts module in float64, p from HF's router logits and the score function HF weighs by
    (softmax over all E logits; sigmoid routers: the sigmoid affinities, without the selection-only bias),
    S(t) and w_e(t) as HF passes them to its experts. Returns (statistics per layer, the score function found)."""
    config = model.config
    spec = family_spec(config.model_type)
    tol = _tol(model)
    out, scores = {}, set()
    for batch in batches:
        B, S = batch["input_ids"].shape
        mask = batch["attention_mask"].reshape(-1).bool()
        rows = torch.arange(B).repeat_interleave(S)
        for layer, hf in _hf_moe_inputs(model, batch).items():
            x, z, idx, w = hf["x"], hf["z"], hf["idx"], hf["w"]
            score = hf_score_function(z, idx, w)
            scores.add(score)
            probs = z.double().sigmoid() if score == "sigmoid" else z.double().softmax(-1)
            block64 = copy.deepcopy(hf["block"]).double()
            if hasattr(block64.experts, "config"):  # Llama 4's and DBRX's experts have one eager path and no config
                block64.experts.config._experts_implementation = "eager"  # the copy's own config (deepcopy)
            outputs = _hf_expert_outputs(block64, x, spec)
            E = z.shape[1]
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
                p = probs[t]
                f = outputs[t]
                if _handwritten_applies(spec, config):
                    hand = torch.stack([_expert_out(hf["block"], config, e, x[t]).double() for e in range(E)])
                    torch.testing.assert_close(hand, f, rtol=tol, atol=tol * float(f.abs().max()))
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
    assert len(scores) == 1, scores
    return out, scores.pop()


def _tol(model):
    """fp32 dot products of length H and I, each a few ulps per term: relative error <= (H + I) eps."""
    c = model.config
    inter = (getattr(c, "moe_intermediate_size", None) or getattr(c, "intermediate_size", None)
             or c.ffn_config.ffn_hidden_size)  # DBRX
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
    ref, score = naive_stats(model, batches)
    _assert_matches(cal, ref, _tol(model))
    m = cal.manifest
    assert m["tokens"] == sum(int(b["attention_mask"].sum()) for b in batches) == int(cal.layers[m["moe_layers"][0]]["n"])
    assert m["num_sequences"] == 5 and m["seq_len"] == 10 and m["complete"]
    assert m["p_definition"] == {"sigmoid": "sigmoid_scores", "softmax": "softmax_all"}[score]
    for name in ("scoring_func", "expert_selection_fn"):  # where the HF config names its score function
        assert getattr(model.config, name, score) == score, name
    spec = family_spec(family)
    weight_owner = f"{spec.router_attr}.{spec.router_weight_attr}".rpartition(".")[0]  # "gate", "gate.wg", ...
    blocks = _moe_blocks(model)
    for layer, st in cal.layers.items():
        block = blocks[layer]
        assert torch.equal(st["router_weight"], _at(block, f"{weight_owner}.weight").float())
        bias = _at(block, f"{weight_owner}.bias")  # a router Linear's logit bias (GPT-OSS)
        assert ("router_bias" in st) == (bias is not None)
        assert bias is None or torch.equal(st["router_bias"], bias.float())
        # the selection-only bias: the block's own (registry correction_bias_attr) or the router's
        selection = _at(block, spec.correction_bias_attr or f"{spec.router_attr}.e_score_correction_bias")
        assert ("e_score_correction_bias" in st) == (selection is not None)
        assert selection is None or torch.equal(st["e_score_correction_bias"], selection.float().reshape(-1))
        assert st["gram"].dtype == torch.float64 and st["count"].dtype == torch.int64


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
    from moe_lab.runs.calibrate import calibration_sequences

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
