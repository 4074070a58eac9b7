"""Checkpoint converters: remote-code MoE checkpoints rewritten as a vanilla transformers class.

``python -m moe_lab.convert deepseek_moe <checkpoint dir> <out dir>`` turns DeepSeekMoE-16B
(deepseek-ai/deepseek-moe-16b-base, remote code, ``model_type: deepseek``) into a ``Qwen2MoeForCausalLM`` folder
whose forward is the same function (float64 test: tests/test_convert.py):

- attention: Llama MHA/GQA with RoPE and no biases -> ``qkv_bias=False`` (Qwen2-MoE's o_proj has no bias);
- the n_shared shared experts are already one MLP of width n_shared * moe_intermediate_size in the checkpoint
  (``mlp.shared_experts``) -> ``shared_expert`` of that width;
- DeepSeek adds the shared MLP ungated; Qwen2-MoE multiplies it by sigmoid(shared_expert_gate(x)): the gate is
  written as zeros (sigmoid(0) = 0.5 exactly) and the shared down projection doubled (exact in any binary float);
- dense FFN layers (``layer_idx < first_k_dense_replace`` or ``layer_idx % moe_layer_freq != 0``) ->
  ``mlp_only_layers``, whose MLP has width ``intermediate_size`` in both classes; ``decoder_sparse_step=1``;
- softmax router, top-k, ``norm_topk_prob`` carried over (false for DeepSeekMoE-16B: no renormalisation).

Numerics: the same function, not the same rounding in low precision: transformers' Qwen2-MoE router takes its
softmax in float32 (the remote code: in the model dtype, bf16). Not carried: DeepSeek's sequence-level auxiliary loss (``seq_aux``; only matters when training with an aux
loss, Qwen2-MoE's is the batch-level one) and the 1e-20 in its renormalisation denominator. The converted
model has one extra parameter vector per MoE layer (the zero gate, 27 x 2048 = 55,296 for DeepSeekMoE-16B).
Shards are streamed one at a time (peak memory: one shard); the output folder appears atomically.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .moe.patch import atomic_export

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "generation_config.json")
INDEX = "model.safetensors.index.json"


def _require(src: dict, field: str, allowed) -> None:
    value = src.get(field)
    if value not in allowed:
        raise ValueError(f"deepseek_moe: config.json {field}={value!r} has no Qwen2-MoE equivalent "
                         f"(supported: {allowed}); this converter covers DeepSeekMoE-16B")


def deepseek_moe_dense_layers(src: dict) -> list[int]:
    """Decoder layers whose FFN is DeepSeek's dense MLP (the remote code's ``DeepseekDecoderLayer`` rule)."""
    k, freq = int(src.get("first_k_dense_replace", 0)), int(src.get("moe_layer_freq", 1))
    return [i for i in range(int(src["num_hidden_layers"])) if not (i >= k and i % freq == 0)]


def deepseek_moe_config(src: dict):
    """The ``Qwen2MoeConfig`` of a DeepSeekMoE ``config.json`` (a dict); refuses fields without an equivalent."""
    from transformers import Qwen2MoeConfig

    _require(src, "model_type", ("deepseek",))
    _require(src, "scoring_func", ("softmax", None))
    _require(src, "attention_bias", (False, None))
    _require(src, "rope_scaling", (None,))
    _require(src, "hidden_act", ("silu",))
    if not src.get("n_routed_experts") or not src.get("n_shared_experts"):
        raise ValueError("deepseek_moe: config.json needs n_routed_experts and n_shared_experts (Qwen2-MoE always "
                         "has a shared expert); this converter covers DeepSeekMoE-16B (64 routed, 2 shared)")
    heads = int(src["num_attention_heads"])
    return Qwen2MoeConfig(
        vocab_size=src["vocab_size"], hidden_size=src["hidden_size"], intermediate_size=src["intermediate_size"],
        num_hidden_layers=src["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=src.get("num_key_value_heads") or heads, hidden_act="silu",
        max_position_embeddings=src.get("max_position_embeddings", 4096),
        initializer_range=src.get("initializer_range", 0.02), rms_norm_eps=src.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(src.get("tie_word_embeddings", False)),
        rope_parameters={"rope_type": "default", "rope_theta": float(src.get("rope_theta", 10000.0))},
        use_sliding_window=False, attention_dropout=src.get("attention_dropout", 0.0), decoder_sparse_step=1,
        moe_intermediate_size=src["moe_intermediate_size"],
        shared_expert_intermediate_size=int(src["n_shared_experts"]) * int(src["moe_intermediate_size"]),
        num_experts=src["n_routed_experts"], num_experts_per_tok=src["num_experts_per_tok"],
        norm_topk_prob=bool(src.get("norm_topk_prob", False)),
        router_aux_loss_coef=src.get("aux_loss_alpha", 0.001), mlp_only_layers=deepseek_moe_dense_layers(src),
        qkv_bias=False, bos_token_id=src.get("bos_token_id"), eos_token_id=src.get("eos_token_id"),
        pad_token_id=src.get("pad_token_id"), dtype=src.get("torch_dtype", "bfloat16"))


_SHARED = re.compile(r"^(model\.layers\.\d+\.mlp)\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")
_ROUTER = re.compile(r"^(model\.layers\.\d+\.mlp)\.gate\.weight$")


def deepseek_moe_tensors(key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The Qwen2-MoE (per-expert checkpoint layout, which transformers packs on load) tensors of one DeepSeekMoE
    tensor. Every other key (attention, norms, embeddings, routed experts, dense MLPs) keeps its name."""
    shared = _SHARED.match(key)
    if shared:
        prefix, proj = shared.groups()
        yield f"{prefix}.shared_expert.{proj}.weight", tensor * 2 if proj == "down_proj" else tensor
        return
    yield key, tensor
    router = _ROUTER.match(key)
    if router:  # one zero shared-expert gate per MoE layer, written beside its router
        yield f"{router.group(1)}.shared_expert_gate.weight", tensor.new_zeros(1, tensor.shape[1])


def _shards(src: Path) -> list[str]:
    index = src / INDEX
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    names = sorted(p.name for p in src.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"{src}: no *.safetensors shards (convert .bin checkpoints to safetensors first)")
    return names


def convert_deepseek_moe(src: str | Path, out: str | Path) -> Path:
    """Write the Qwen2-MoE version of the DeepSeekMoE checkpoint folder ``src`` to ``out`` (atomically)."""
    src, out = Path(src), Path(out)
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"{src}: no config.json (pass the downloaded deepseek-moe-16b-base folder)")
    source = json.loads((src / "config.json").read_text())
    config = deepseek_moe_config(source)
    shards = _shards(src)

    def write(tmp: Path) -> None:
        weight_map, total = {}, 0
        for shard in shards:
            tensors = {}
            with safe_open(str(src / shard), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    for name, tensor in deepseek_moe_tensors(key, f.get_tensor(key)):
                        tensors[name] = tensor.contiguous()
            save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
            for name, tensor in tensors.items():
                weight_map[name] = shard
                total += tensor.numel() * tensor.element_size()
            del tensors
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                            indent=2, sort_keys=True))
        config.save_pretrained(tmp)
        for name in COPIED_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, tmp / name)
        (tmp / "moe_lab_conversion.json").write_text(json.dumps(
            {"converter": "deepseek_moe", "source": str(src.resolve()), "source_model_type": "deepseek"}, indent=2))

    if out.exists():
        raise FileExistsError(f"{out} exists: pass a new output folder (conversion never overwrites)")
    return atomic_export(out, write)


CONVERTERS = {"deepseek_moe": convert_deepseek_moe}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m moe_lab.convert", description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(CONVERTERS))
    parser.add_argument("checkpoint", help="downloaded checkpoint folder (config.json + *.safetensors)")
    parser.add_argument("out", help="new output folder")
    args = parser.parse_args(argv)
    out = CONVERTERS[args.kind](args.checkpoint, args.out)
    print(f"wrote {out} ({args.kind} -> Qwen2MoeForCausalLM); use it with model.pretrained={out}")
    return out


if __name__ == "__main__":
    main()
