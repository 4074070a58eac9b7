"""bf16 training throughput and model FLOP utilisation (MFU) of each method on one CUDA GPU, beside vanilla HF.

Model: OLMoE-1B-7B's widths (hidden 2048, 64 experts top-8, expert width 1024, 16 heads, vocab 50304) with
``--layers`` decoder layers (default 4, so optimizer state fits one GPU), random weights. Each method trains
``--steps`` AdamW steps under bf16 autocast over fp32 master weights (what ``hardware=gpu``'s bf16-mixed does);
one model at a time, so peak memory is the method's own. MFU = model FLOPs per second / the GPU's dense bf16
peak, model FLOPs per token = 6 x active parameters (attention projections, router, top-k experts, lm_head)
+ 6 x layers x seq x hidden (causal attention scores and values). DenseMixer's extra forward of the inactive
experts is not counted as model FLOPs (its MFU is conventional-SFT-equivalent work per second).
``sft_bf16_compute`` is moe-lab sft with ``method.master_weights=optimizer``: bf16 weights for compute, fp32 masters
in the optimizer (:mod:`moe_lab.runtime.optimizer_masters`), beside ``hf_bf16_weights`` (bf16 weights, no masters).

    python bench/mfu.py [--layers 4] [--batch 8] [--seq 2048,8192] [--steps 10] [--methods hf,sft,densemixer,...]

Prints one line per (sequence length, method): tokens/s, step time, MFU, peak memory, and the ratios to vanilla
HF's and moe-lab sft's steps (``--seq`` takes a comma list: a sweep; the batch keeps ``--batch`` x 2048 tokens).
Last, the published anchors, each with its own model and GPU, beside which ours stand (they are not runs of ours).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time

import torch
import transformers
from methods import build, optimizer  # bench/ is on sys.path when run as `python bench/mfu.py`
from sft_step import autocast_step

from moe_lab.runtime.optimizer_masters import FP32MasterCopies

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
#: published throughput of other tools, as their authors measured it (not comparable model for model: read as anchors)
ANCHORS = (
    "torchtitan, Qwen3-30B-A3B, natural routing, 8 x H200: MFU 0.299",
    "NVIDIA NeMo AutoModel, Qwen3-30B-A3B, H100: MFU 0.28",
    "SonicMoE, fine-grained 7B MoE of OLMoE's kind, H100: about 38k tokens/s/GPU",
    "Liger's fused MoE kernel, Qwen3-30B-A3B expert shapes: 413 TFLOP/s forward + backward",
)


def olmoe_config(layers: int, seq: int) -> transformers.OlmoeConfig:
    return transformers.OlmoeConfig(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        max_position_embeddings=max(4096, seq), norm_topk_prob=False,
    )


def flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs of one trained token (forward + backward = 3 x forward, matmuls only)."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    active = layers * (4 * h * h + h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * i) + h * cfg.vocab_size
    return 6 * active + 6 * layers * seq * h


def peak_tflops() -> float:
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), float("nan"))


def bf16_copy(base):
    """``base`` in bf16, for ``build`` (which copies it once more) without touching the fp32 base."""
    return copy.deepcopy(base).to(torch.bfloat16)


def time_method(method: str, base, batch, steps: int, warmup: int) -> tuple[float, float]:
    """(median step seconds, peak GiB allocated) of ``steps`` AdamW steps after ``warmup``."""
    gc.collect()  # nothing of the previous method may count in this one's peak
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    vanilla = method.startswith("hf")
    bf16_compute = method == "sft_bf16_compute"
    model = copy.deepcopy(base).to(torch.bfloat16) if method == "hf_bf16_weights" else base if vanilla \
        else build("sft", bf16_copy(base)) if bf16_compute else build(method, base)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5) if vanilla \
        else optimizer(model)
    masters = FP32MasterCopies(opt) if bf16_compute else None
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        autocast_step(model, opt, batch, "cuda", masters)
        if not vanilla:
            model.moe_lab_patch.after_optimizer_step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del opt, model
    gc.collect()
    torch.cuda.empty_cache()
    return statistics.median(times), peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", default="2048", help="sequence length, or a comma list to sweep (e.g. 2048,8192)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--methods", default="hf,hf_bf16_weights,sft,sft_bf16_compute,frozen_router,condenser,esft,densemixer,compressed_experts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/mfu.py needs a CUDA GPU")
    for seq in (int(s) for s in str(args.seq).split(",")):
        run_seq(args, seq, max(1, args.batch * 2048 // seq))
    print("anchors (published, their model and GPU): " + "; ".join(ANCHORS))


def run_seq(args, seq: int, batch_size: int) -> None:
    """Every method at one sequence length (``batch_size`` sequences a step)."""
    torch.manual_seed(0)
    cfg = olmoe_config(args.layers, seq)
    base = transformers.AutoModelForCausalLM.from_config(cfg).cuda().train()
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    tokens = batch_size * seq
    model_flops = flops_per_token(cfg, seq) * tokens
    peak = peak_tflops()
    params = sum(p.numel() for p in base.parameters())
    print(f"bench=mfu gpu={torch.cuda.get_device_name()} torch={torch.__version__} "
          f"transformers={transformers.__version__} experts_implementation={base.config._experts_implementation} "
          f"config=olmoe-widths(h2048,E64,k8,I1024,L{args.layers}) params={params / 1e9:.2f}B "
          f"batch={batch_size}x{seq} steps={args.steps} peak_bf16_tflops={peak}")
    results = {}
    for method in args.methods.split(","):
        try:
            step, mem = time_method(method, base, batch, args.steps, args.warmup)
        except Exception as exc:  # noqa: BLE001 - report and go on: one broken method must not hide the others' numbers
            print(f"method={method} error={type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        results[method] = step
        ratio = {ref: f"{step / results[ref]:.3f}" if ref in results else "n/a" for ref in ("hf", "sft")}
        print(f"seq={seq} method={method} step_s={step:.4f} tokens_per_s={tokens / step:,.0f} "
              f"tflops={model_flops / step / 1e12:.1f} mfu={model_flops / step / 1e12 / peak:.3f} "
              f"peak_mem_gib={mem:.1f} step_ratio_vs_hf={ratio['hf']} step_ratio_vs_sft={ratio['sft']}")
    del base
    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
