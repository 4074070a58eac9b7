"""DeepSeekMoE -> Qwen2-MoE conversion: a float64 DeepSeekMoE forward written from the architecture (the remote
code's DeepseekForCausalLM: RMSNorm, RoPE MHA/GQA, dense first layer, softmax top-k without renormalisation,
ungated shared MLP) on a tiny random checkpoint in the original key layout equals vanilla Qwen2-MoE's logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from moe_lab.convert import convert_deepseek_moe, deepseek_moe_config, main

SRC = dict(model_type="deepseek", architectures=["DeepseekForCausalLM"], vocab_size=61, hidden_size=32,  # noqa: C408
           intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
           first_k_dense_replace=1, moe_layer_freq=1, norm_topk_prob=False, scoring_func="softmax",
           attention_bias=False, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
           max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
           torch_dtype="float32", aux_loss_alpha=0.001, seq_aux=True)


def deepseek_state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random DeepSeekMoE weights in the remote code's key layout (float32)."""
    gen = torch.Generator().manual_seed(seed)
    h, hd = cfg["hidden_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def w(*shape, scale=0.3):
        return torch.randn(shape, generator=gen) * scale

    sd = {"model.embed_tokens.weight": w(cfg["vocab_size"], h), "model.norm.weight": 1 + w(h, scale=0.1),
          "lm_head.weight": w(cfg["vocab_size"], h)}

    def mlp(prefix, width):
        sd.update({f"{prefix}.gate_proj.weight": w(width, h), f"{prefix}.up_proj.weight": w(width, h),
                   f"{prefix}.down_proj.weight": w(h, width)})

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        sd.update({f"{p}.self_attn.q_proj.weight": w(h, h), f"{p}.self_attn.k_proj.weight": w(kv, h),
                   f"{p}.self_attn.v_proj.weight": w(kv, h), f"{p}.self_attn.o_proj.weight": w(h, h),
                   f"{p}.input_layernorm.weight": 1 + w(h, scale=0.1),
                   f"{p}.post_attention_layernorm.weight": 1 + w(h, scale=0.1)})
        if i < cfg["first_k_dense_replace"]:
            mlp(f"{p}.mlp", cfg["intermediate_size"])
            continue
        sd[f"{p}.mlp.gate.weight"] = w(cfg["n_routed_experts"], h, scale=1.0)
        for e in range(cfg["n_routed_experts"]):
            mlp(f"{p}.mlp.experts.{e}", cfg["moe_intermediate_size"])
        mlp(f"{p}.mlp.shared_experts", cfg["n_shared_experts"] * cfg["moe_intermediate_size"])
    return sd


def reference_forward(sd: dict, cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeekMoE logits in float64, one sequence, written from the architecture."""
    sd = {k: v.double() for k, v in sd.items()}
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // n_heads
    T = ids.shape[0]

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg["rms_norm_eps"])

    def swiglu(x, p):
        g = x @ sd[f"{p}.gate_proj.weight"].T
        return (g * torch.sigmoid(g) * (x @ sd[f"{p}.up_proj.weight"].T)) @ sd[f"{p}.down_proj.weight"].T

    # RoPE angles in float32, as both the remote code (``.float()`` inv_freq, cos/sin cached in float32) and
    # transformers compute them whatever the model dtype; everything else in float64
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]  # T x hd/2
    cos, sin = torch.cos(ang).double(), torch.sin(ang).double()

    def rope(x):  # x: heads x T x hd; pairs (j, j + hd/2) rotate by angle j
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    x = sd["model.embed_tokens.weight"][ids]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        y = rms(x, sd[f"{p}.input_layernorm.weight"])
        q = rope((y @ sd[f"{p}.self_attn.q_proj.weight"].T).view(T, n_heads, hd).transpose(0, 1))
        k = rope((y @ sd[f"{p}.self_attn.k_proj.weight"].T).view(T, n_kv, hd).transpose(0, 1))
        v = (y @ sd[f"{p}.self_attn.v_proj.weight"].T).view(T, n_kv, hd).transpose(0, 1)
        rep = n_heads // n_kv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        att = (q @ k.transpose(1, 2)) / hd ** 0.5
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(0, 1).reshape(T, -1) @ sd[f"{p}.self_attn.o_proj.weight"].T
        y = rms(x, sd[f"{p}.post_attention_layernorm.weight"])
        if i < cfg["first_k_dense_replace"]:
            x = x + swiglu(y, f"{p}.mlp")
            continue
        probs = (y @ sd[f"{p}.mlp.gate.weight"].T).softmax(-1)
        out = swiglu(y, f"{p}.mlp.shared_experts")
        top = probs.topk(cfg["num_experts_per_tok"], dim=-1).indices
        for t in range(T):
            for e in top[t].tolist():
                out[t] = out[t] + probs[t, e] * swiglu(y[t], f"{p}.mlp.experts.{e}")
        x = x + out
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def write_checkpoint(path, cfg, sd, shards=2):
    """config.json + ``shards`` safetensors files with an index, keys split so a layer's router and its experts
    sit in different shards."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    keys = sorted(sd)
    names = [f"model-{j + 1:05d}-of-{shards:05d}.safetensors" for j in range(shards)]
    weight_map = {k: names[n % shards] for n, k in enumerate(keys)}
    for name in names:
        save_file({k: sd[k] for k in keys if weight_map[k] == name}, str(path / name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _rms_in_input_dtype(self, x):
    """transformers' RMSNorm (like the remote code's) computes in float32; in float64 here, so the comparison
    checks the mapping to float64 precision rather than two identical float32 roundings."""
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def _router_in_input_dtype(self, x):
    """transformers' Qwen2-MoE router takes its softmax in float32 (the remote code: in the input dtype)."""
    logits = torch.nn.functional.linear(x.reshape(-1, self.hidden_dim), self.weight)
    top, idx = logits.softmax(-1).topk(self.top_k, dim=-1)
    return logits, top, idx


def test_converted_deepseek_moe_equals_float64_reference(tmp_path, monkeypatch):
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    monkeypatch.setattr(modeling_qwen2_moe.Qwen2MoeRMSNorm, "forward", _rms_in_input_dtype)
    monkeypatch.setattr(modeling_qwen2_moe.Qwen2MoeTopKRouter, "forward", _router_in_input_dtype)
    sd = deepseek_state(SRC)
    write_checkpoint(tmp_path / "ds", SRC, sd)
    out = main(["deepseek_moe", str(tmp_path / "ds"), str(tmp_path / "qwen")])
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, attn_implementation="sdpa",  # eager: softmax in float32
                                                         experts_implementation="eager")
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    assert model.config.mlp_only_layers == [0] and model.config.qkv_bias is False
    assert model.config.shared_expert_intermediate_size == 2 * SRC["moe_intermediate_size"]
    layer = model.model.layers[2].mlp
    assert torch.equal(layer.shared_expert_gate.weight, torch.zeros(1, SRC["hidden_size"], dtype=torch.float64))
    torch.testing.assert_close(layer.shared_expert.down_proj.weight,
                               2 * sd["model.layers.2.mlp.shared_experts.down_proj.weight"].double())
    ids = torch.randint(0, SRC["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for row in range(ids.shape[0]):
        want = reference_forward(sd, SRC, ids[row])
        assert (logits[row] - want).abs().max().item() < 1e-10
    # the routing is far from uniform: the top-k choice matters (a dense-average forward differs)
    assert want.abs().max() > 1


def test_dense_layers_follow_first_k_and_layer_freq():
    cfg = deepseek_moe_config({**SRC, "num_hidden_layers": 6, "first_k_dense_replace": 2, "moe_layer_freq": 2})
    assert cfg.mlp_only_layers == [0, 1, 3, 5] and cfg.decoder_sparse_step == 1


@pytest.mark.parametrize("field,value", [("scoring_func", "sigmoid"), ("attention_bias", True),
                                         ("rope_scaling", {"type": "linear", "factor": 2.0}),
                                         ("model_type", "deepseek_v2")])
def test_refuses_fields_without_equivalent(field, value):
    with pytest.raises(ValueError, match=field):
        deepseek_moe_config({**SRC, field: value})


def test_refuses_existing_output(tmp_path):
    write_checkpoint(tmp_path / "ds", SRC, deepseek_state(SRC), shards=1)
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="never overwrites"):
        convert_deepseek_moe(tmp_path / "ds", tmp_path / "out")


def test_condensed_converted_deepseek_moe_exports_as_vanilla_qwen2_moe(tmp_path):
    """CD-MoE on the converted DeepSeekMoE (its presets' model): the shared expert's gate is the converter's zero
    gate (sigmoid(0) = 0.5, constant), so a condensed layer (shared expert + K_r retained experts with fixed gates)
    is one dense SwiGLU of width S + K_r*I and the whole model a VANILLA Qwen2-MoE (that layer in
    ``mlp_only_layers``), not moe-lab's condensed format. Oracle: the condensed model's logits; the dense MLP sums
    the same products in one matmul instead of three, so float32 rounding (atol 1e-5 on O(1) logits) remains.
    A trained (token-wise, nonzero) gate is refused with the fix."""
    from moe_lab.compress import calibrate, condense
    from moe_lab.compress.condense import to_vanilla

    write_checkpoint(tmp_path / "ds", SRC, deepseek_state(SRC))
    model = transformers.AutoModelForCausalLM.from_pretrained(main(["deepseek_moe", str(tmp_path / "ds"),
                                                                    str(tmp_path / "qwen")])).eval()
    gen = torch.Generator().manual_seed(5)
    batches = [{"input_ids": torch.randint(0, SRC["vocab_size"], (3, 10), generator=gen),
                "attention_mask": torch.ones(3, 10, dtype=torch.long)} for _ in range(2)]
    condensed = condense(model, calibrate(model, batches), [2], {2: [1, 6]})
    with torch.no_grad():
        want = condensed(input_ids=batches[0]["input_ids"]).logits
    to_vanilla(condensed).save_pretrained(tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(back).__name__ == "Qwen2MoeForCausalLM" and back.config.mlp_only_layers == [0, 2]
    assert type(back.model.layers[2].mlp).__name__ == "Qwen2MoeMLP"
    assert type(back.model.layers[1].mlp).__name__ == "Qwen2MoeSparseMoeBlock"  # not condensed: kept as is
    assert not (tmp_path / "export" / "condense_manifest.json").exists()
    with torch.no_grad():
        got = back(input_ids=batches[0]["input_ids"]).logits
    assert want.abs().max() > 1 and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    trained = condense(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen").eval(), None, [2])
    with torch.no_grad():
        trained.model.layers[2].mlp.shared_expert_gate.weight.fill_(0.01)
    with pytest.raises(ValueError, match="token-wise sigmoid gate.*export_condensed"):
        to_vanilla(trained)
