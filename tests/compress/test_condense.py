"""CD-MoE (docs/specs/compression.md 3.10): fixed gates, condensed layer, JS, searches, export — against
independent computations."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from moe_lab.compress import calibrate, condense, export_condensed, js_divergence, load_condensed
from moe_lab.compress.condense import fixed_gates
from moe_lab.compress.condense_search import (
    ExpertSearch,
    LayerSearch,
    candidate_count,
    capture,
    expert_baseline,
    greedy_expert_search,
)
from moe_lab.compress.scores import scores
from moe_lab.moe.view import find_moe_layers
from tests.conftest import build_tiny, random_batch

FP32_EPS = torch.finfo(torch.float32).eps


def batches(n=2, seed=0):
    return [random_batch(3, 10, seed=seed + i) for i in range(n)]


@pytest.fixture(scope="module")
def ds():
    model = build_tiny("deepseek_v2").eval()
    cal = calibrate(model, batches())
    return model, cal


def logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


# fixed gates -----------------------------------------------------------------------------------------------
def test_fixed_gates_equal_cp_for_non_renormalising_softmax(ds):
    _model, cal = ds
    cp = scores(cal, "cp")
    for layer in cal.moe_layers:
        gates, valid = fixed_gates(cal, layer)
        assert torch.allclose(gates[valid], cp[layer][valid], rtol=1e-12, atol=0)


def test_fixed_gates_renormalising_family_mean_weight_and_fallbacks():
    model = build_tiny("qwen3_moe").eval()  # norm_topk_prob: true -> renormalised weights
    batch = random_batch(3, 10)
    cal = calibrate(model, [batch])
    view = find_moe_layers(model)[0]
    # oracle: route the captured block inputs by hand
    cache = capture(model, [batch], [view.index])[view.index]
    p = torch.softmax(cache.x.double() @ view.router_weight.double().T, -1)
    top = p.topk(view.top_k, -1)
    w = torch.zeros_like(p).scatter_(1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    sel = w > 0
    expected = w.sum(0) / sel.sum(0).clamp_min(1)
    gates, valid = fixed_gates(cal, view.index)
    assert torch.equal(valid, sel.any(0))
    assert torch.allclose(gates[valid], expected[valid], rtol=1e-5)
    if not bool(valid.all()):
        const, all_valid = fixed_gates(cal, view.index, "const")
        assert bool(all_valid.all()) and torch.all(const[~valid] == 0.06)
        mean, _ = fixed_gates(cal, view.index, "layer_mean")
        assert torch.allclose(mean[~valid], gates[valid].mean().expand(int((~valid).sum())))


def test_missing_statistics_refused(ds):
    model, cal = ds
    broken = copy.copy(cal)
    broken.layers = {i: {k: v for k, v in s.items() if k != "w_sel"} for i, s in cal.layers.items()}
    with pytest.raises(ValueError, match="w_sel"):
        greedy_expert_search(model, broken, batches(1), 1)


# condensed layer -------------------------------------------------------------------------------------------
def _packed_slices(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) copies, from the packed tensors or DBRX's w1 / v1 / w2 [E*I, H] rows."""
    if hasattr(experts, "mlp"):  # DBRX: expert e owns rows e*I .. (e+1)*I-1; w2 is applied as h @ w2_e
        E, I = experts.num_experts, experts.ffn_hidden_size
        w1, v1, w2 = (w.detach().reshape(E, I, -1) for w in (experts.mlp.w1, experts.mlp.v1, experts.mlp.w2))
        return torch.cat([w1, v1], dim=1).clone(), w2.transpose(1, 2).clone()
    return experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen2_moe", pytest.param("dbrx", marks=pytest.mark.slow)])
def test_condensed_layer_equals_shared_plus_fixed_gated_experts(family):
    model = build_tiny(family).eval()
    cal = calibrate(model, batches(1))
    view = find_moe_layers(model)[0]
    gates, _valid = fixed_gates(cal, view.index, "const")
    keep = [5, 0, 3]
    gu, dn = _packed_slices(view.experts)
    shared = copy.deepcopy(view.shared)
    shared_gate = copy.deepcopy(view.shared_gate)
    condense(model, cal, [view.index], {view.index: keep}, fallback="const")
    module = model.get_submodule(view.name)
    x = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    # independent oracle: explicit per-expert SwiGLU with the original packed slices
    flat = x.reshape(-1, x.shape[-1]).double()
    I = dn.shape[2]
    want = torch.zeros_like(flat)
    for e in keep:
        g, u = flat @ gu[e, :I].double().T, flat @ gu[e, I:].double().T
        want += gates[e] * ((F.silu(g) * u) @ dn[e].double().T)
    if shared is not None:
        s = F.linear(F.silu(F.linear(flat, shared.gate_proj.weight.double())) * F.linear(flat, shared.up_proj.weight.double()),
                     shared.down_proj.weight.double())
        if shared_gate is not None:
            s = torch.sigmoid(F.linear(flat, shared_gate.weight.double())) * s
        want = want + s
    want = want.reshape(x.shape)
    with torch.no_grad():
        got = module(x).double()
    tol = 64 * FP32_EPS * want.abs().max()
    assert (got - want).abs().max() <= tol
    assert module.expert_ids.tolist() == keep and module.gate_up_proj.shape[0] == 3
    assert {n for n, _ in module.named_buffers()} == {"gates", "expert_ids"}


def test_all_experts_uniform_router_equals_moe():
    """3.10-2: k = E, zero router -> every gate 1/E -> the condensed model IS the MoE model."""
    model = build_tiny("deepseek_v2", num_experts_per_tok=8).eval()
    for view in find_moe_layers(model):
        view.router_weight.data.zero_()
    cal = calibrate(model, batches(1))
    batch = random_batch(2, 9, seed=7)
    ref = logits(model, batch)
    layers = cal.moe_layers
    condense(model, cal, layers, {i: list(range(8)) for i in layers})
    for i in layers:
        assert torch.allclose(model.get_submodule(f"model.layers.{i}.mlp").gates,
                              torch.full((8,), 1 / 8), rtol=1e-6)
    got = logits(model, batch)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_cd_moe_s_is_shared_path_only(ds):
    """3.10-3: K_r = 0 == the MoE block with every routed expert zeroed."""
    model, cal = ds
    oracle = copy.deepcopy(model)
    for view in find_moe_layers(oracle):
        view.down_proj.data.zero_()
    batch = random_batch(2, 8, seed=4)
    condensed = condense(copy.deepcopy(model), cal, cal.moe_layers)
    assert torch.allclose(logits(condensed, batch), logits(oracle, batch), atol=1e-6, rtol=1e-6)


def test_dense_layer_refused(ds):
    model, cal = ds
    with pytest.raises(ValueError, match="layer 0, which is dense"):
        condense(copy.deepcopy(model), cal, [0, 1])


def test_batched_eval_and_activation_checkpointing(ds):
    model, cal = ds
    m = condense(copy.deepcopy(model), cal, [1], {1: [0, 1]})
    batch = random_batch(3, 10, pad_rows=())
    full = logits(m, batch)
    for r in range(3):
        one = logits(m, {k: v[r:r + 1] for k, v in batch.items()})
        assert torch.allclose(one, full[r:r + 1], atol=1e-5)
    m.train()
    m.activation_checkpointing_enable()
    m(**batch).loss.backward()
    grad = m.get_submodule("model.layers.1.mlp").gate_up_proj.grad
    assert grad is not None and grad.abs().sum() > 0


# JS divergence ----------------------------------------------------------------------------------------------
def js_reference(a, b, mask, eps=1e-10):
    """float64, explicit loops over sequences and tokens (spec 3.4)."""
    per_seq = []
    for j in range(a.shape[0]):
        vals = []
        for t in range(a.shape[1]):
            if not mask[j, t]:
                continue
            u = [math.exp(v) for v in a[j, t].double().tolist()]
            v = [math.exp(w) for w in b[j, t].double().tolist()]
            su, sv = sum(u), sum(v)
            u, v = [x / su for x in u], [x / sv for x in v]
            m = [(x + y) / 2 for x, y in zip(u, v)]
            kl = lambda p, q: sum((pi + eps) * (math.log(pi + eps) - math.log(qi + eps)) for pi, qi in zip(p, q))
            vals.append(0.5 * kl(u, m) + 0.5 * kl(v, m))
        if vals:
            per_seq.append(sum(vals) / len(vals))
    return sum(per_seq) / len(per_seq)


def test_js_against_float64_reference_and_properties():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 6, 16, generator=gen) * 3, torch.randn(3, 6, 16, generator=gen) * 3
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :5] = 0
    got = float(js_divergence(a, b, mask))
    want = js_reference(a, b, mask)
    assert abs(got - want) <= 16 * 16 * FP32_EPS * max(want, 1e-3)
    assert float(js_divergence(a, a, mask)) == 0.0
    assert float(js_divergence(b, a, mask)) == pytest.approx(got, rel=1e-6)
    big = torch.zeros(1, 1, 16)
    big[0, 0, 0] = 80.0
    assert float(js_divergence(big, -big)) <= math.log(2) * (1 + 16 * FP32_EPS) + 16 * 1e-10
    # padding side: moving each row's real tokens to the other end changes nothing
    right_a, right_b, right_mask = torch.zeros_like(a), torch.zeros_like(b), torch.zeros_like(mask)
    for j in range(3):
        n = int(mask[j].sum())
        right_a[j, :n], right_b[j, :n], right_mask[j, :n] = a[j, 6 - n:], b[j, 6 - n:], 1
    assert float(js_divergence(right_a, right_b, right_mask)) == pytest.approx(got, rel=1e-6)
    with pytest.raises(ValueError, match="condense.target"):
        js_divergence(a, b, target="logits")


# searches ---------------------------------------------------------------------------------------------------
def test_candidate_count():
    assert candidate_count(64, 6) == 369
    assert math.comb(64, 6) == 74_974_368


def test_cached_search_equals_full_forward(ds):
    """3.10-6 (+ 5, 10): cached candidate losses == condense-and-run-the-model losses; prefixes; first pick."""
    model, cal = ds
    data = batches(1)
    layer = 2
    view = {v.index: v for v in find_moe_layers(model)}[layer]
    cache = capture(model, data, [layer])[layer]
    fast = ExpertSearch(model, cal, view, cache, data, cached=True)
    slow = ExpertSearch(model, cal, view, cache, data, cached=False)
    chosen = []
    for _ in range(2):
        lf, ls = fast.losses(chosen), slow.losses(chosen)
        finite = torch.isfinite(ls)
        assert torch.equal(finite, torch.isfinite(lf))
        assert torch.allclose(lf[finite], ls[finite], rtol=1e-4, atol=1e-9)
        assert int(lf.argmin()) == int(ls.argmin())
        chosen.append(int(lf.argmin()))
    lists3 = greedy_expert_search(model, cal, data, 3, [layer])
    lists2 = greedy_expert_search(model, cal, data, 2, [layer])
    assert lists3[layer][:2] == chosen and lists2[layer] == chosen
    assert greedy_expert_search(model, cal, data, 3, [layer], store_outputs=False) == lists3
    single = fast.losses([])
    assert float(single[chosen[0]]) == float(single.min())


def test_layer_search_global_rank_first_equals_greedy_first(ds):
    model, cal = ds
    experts = greedy_expert_search(model, cal, batches(1), 2)
    search = LayerSearch(model, cal, batches(1), experts)
    order, losses = search.greedy(2)
    assert search.global_rank()[0] == order[0]
    assert sorted(order) == sorted(cal.moe_layers) and losses[0] <= losses[1] + 1e-6
    assert LayerSearch(model, cal, batches(1), experts, metric="ppl").greedy(1)[0][0] in cal.moe_layers


def test_expert_baselines(ds):
    model, cal = ds
    view = find_moe_layers(model)[0]
    l1 = expert_baseline(model, cal, "l1", 3)
    _, valid = fixed_gates(cal, view.index)
    norms = [float(view.gate_up_proj[e].abs().sum() + view.down_proj[e].abs().sum()) if valid[e] else math.inf
             for e in range(view.num_experts)]
    assert l1[view.index] == sorted(range(view.num_experts), key=lambda e: (norms[e], e))[:3]
    assert expert_baseline(model, cal, "random", 3, seed=1) == expert_baseline(model, cal, "random", 3, seed=1)
    assert len(expert_baseline(model, cal, "alpha_hill", 3)[view.index]) == 3


# export -----------------------------------------------------------------------------------------------------
def test_export_drops_unused_experts_and_reloads_identically(ds, tmp_path):
    """3.10-9, done-when of item 3: condensed tiny DeepSeek-V2, exported and reloaded, same logits."""
    model, cal = ds
    m = condense(copy.deepcopy(model), cal, [1, 2], {1: [3, 1], 2: []})
    batch = random_batch(2, 8, seed=5)
    ref = logits(m, batch)
    export_condensed(m, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["model.layers.1.mlp.gate_up_proj"].shape[0] == 2
    assert state["model.layers.2.mlp.gate_up_proj"].shape[0] == 0
    assert not any(k.startswith("model.layers.1.mlp.experts") for k in state)
    back = load_condensed(tmp_path)
    assert torch.equal(logits(back, batch), ref)


@pytest.mark.slow
def test_dbrx_condensed_export_drops_unused_experts_and_reloads_identically(tmp_path):
    """The same on DBRX (experts as w1 / v1 / w2 [E*I, H] rows): the condensed layer holds copies of the retained
    experts' rows, the export none of experts.mlp, and the reload gives the same logits."""
    model = build_tiny("dbrx").eval()
    cal = calibrate(model, batches(1))
    m = condense(copy.deepcopy(model), cal, [1], {1: [6, 2]}, fallback="const")
    batch = random_batch(2, 8, seed=5)
    ref = logits(m, batch)
    export_condensed(m, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["transformer.blocks.1.ffn.gate_up_proj"].shape == (2, 64, 64)  # [K, 2I, H]
    assert not any(k.startswith("transformer.blocks.1.ffn.experts") for k in state)
    assert torch.equal(logits(load_condensed(tmp_path), batch), ref)


def test_layer_trim_and_block_influence(ds):
    from moe_lab.compress.condense_search import block_influence, trim, trim_order

    model, cal = ds
    batch = random_batch(2, 8, seed=6, pad_rows=())
    oracle = copy.deepcopy(model)
    block = oracle.get_submodule("model.layers.1.mlp")
    block.experts.down_proj.data.zero_()
    block.shared_experts.down_proj.weight.data.zero_()
    trimmed = trim(copy.deepcopy(model), [1], "moe")
    assert torch.allclose(logits(trimmed, batch), logits(oracle, batch), atol=1e-6)
    # BlockTrim BI of decoder layer 1 from HF's hidden_states (independent of the hooks)
    with torch.no_grad():
        hs = model(input_ids=batch["input_ids"], output_hidden_states=True).hidden_states
    want = 1 - float(F.cosine_similarity(hs[1].double(), hs[2].double(), dim=-1).mean())
    assert block_influence(model, [batch], "block")[1] == pytest.approx(want, rel=1e-5)
    assert sorted(trim_order(model, [batch], "moe")) == cal.moe_layers
    skipped = trim(copy.deepcopy(model), [1], "block")
    shorter = copy.deepcopy(model)
    del shorter.model.layers[1]
    shorter.config.num_hidden_layers = 2
    with torch.no_grad():
        kw = {"input_ids": batch["input_ids"], "use_cache": False}
        assert torch.equal(skipped(**kw).logits, shorter(**kw).logits)


def test_vanilla_export_qwen3_moe(tmp_path):
    """Qwen3-MoE (no shared expert, mlp_only_layers): condensed layers become vanilla dense MLPs."""
    import transformers

    from moe_lab.compress.condense import to_vanilla

    model = build_tiny("qwen3_moe").eval()
    cal = calibrate(model, batches(1))
    m = condense(model, cal, [1], {1: [1, 4]})
    batch = random_batch(2, 8, seed=3)
    ref = logits(m, batch)
    vanilla = to_vanilla(m)
    vanilla.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.config.mlp_only_layers == [0, 1] and type(back.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"
    assert torch.allclose(logits(back, batch), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="load_condensed"):
        to_vanilla(condense(build_tiny("deepseek_v2").eval(), None, [1]))


def test_condense_twice_equals_once(ds):
    model, cal = ds
    batch = random_batch(2, 8, seed=8)
    once = condense(copy.deepcopy(model), cal, [1, 2], {1: [0], 2: [3]})
    twice = condense(condense(copy.deepcopy(model), cal, [1], {1: [0]}), cal, [2], {2: [3]})
    assert torch.equal(logits(once, batch), logits(twice, batch))
    assert set(twice.moe_lab_condense) == {"1", "2"}


def test_hf_hidden_states_quirk_reads_post_norm_at_last_layer(ds):
    model, cal = ds
    data = batches(1)
    view = find_moe_layers(model)[-1]
    cache = capture(model, data, [view.index])[view.index]
    quirk = ExpertSearch(model, cal, view, cache, data, hf_hidden_states=True)
    b = data[0]
    with torch.no_grad():
        hs = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_hidden_states=True)
    final = hs.hidden_states[-1][b["attention_mask"].bool()]
    assert torch.allclose(quirk.ref, final, atol=1e-5)
    fast, slow = quirk.losses([]), ExpertSearch(model, cal, view, cache, data, cached=False,
                                                hf_hidden_states=True).losses([])
    finite = torch.isfinite(slow)
    assert torch.allclose(fast[finite], slow[finite], rtol=1e-4, atol=1e-9)
    plain = ExpertSearch(model, cal, view, cache, data).losses([])
    assert not torch.allclose(plain[finite], fast[finite])
