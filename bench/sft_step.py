"""Ratio of a moe-lab ``sft`` training step to a vanilla HF training step (same model, same batch).

Bench config: OLMoE-like, hidden 256, 16 experts top-4, 4 layers, batch 8 x 256 tokens. Steps of the two
models are interleaved and the medians compared, so machine noise hits both alike. Target: ratio <= 1.05.

    python bench/sft_step.py [--steps 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import transformers

import moe_lab

BENCH_CONFIG = {
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 8, "num_experts": 16, "num_experts_per_tok": 4, "max_position_embeddings": 512,
}


def train_step(model, optimizer, batch, device: str = "cpu") -> tuple[float, float]:
    """(seconds, loss) of one optimizer step, synchronised before and after on a GPU."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, loss.item()


def autocast_step(model, optimizer, batch, device: str, masters=None) -> None:
    """One optimizer step under bf16 autocast on ``device``; ``masters`` (``FP32MasterCopies``, or None) takes the
    bf16 gradients onto its fp32 copies before the step (``method.master_weights=optimizer``)."""
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    if masters is not None:
        masters.gradients_to_masters()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vanilla = transformers.AutoModelForCausalLM.from_config(transformers.OlmoeConfig(**BENCH_CONFIG)).train()
    ours = copy.deepcopy(vanilla)
    moe_lab.apply(ours, "sft")
    ids = torch.randint(0, BENCH_CONFIG["vocab_size"], (8, 256))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in (("hf", vanilla), ("moe_lab", ours))}
    models = {"hf": vanilla, "moe_lab": ours}
    times = {"hf": [], "moe_lab": []}
    for i in range(args.warmup + args.steps):
        order = ("hf", "moe_lab") if i % 2 == 0 else ("moe_lab", "hf")
        for name in order:
            t, _ = train_step(models[name], optimizers[name], batch)
            if i >= args.warmup:
                times[name].append(t)
    hf, ml = statistics.median(times["hf"]), statistics.median(times["moe_lab"])
    print(f"bench=sft_step config=olmoe-like(h256,E16,k4,L4) batch=8x256 steps={args.steps}")
    print(f"hf_step_median_s={hf:.4f} moe_lab_step_median_s={ml:.4f}")
    print(f"step_ratio={ml / hf:.3f} target<=1.05")


if __name__ == "__main__":
    main()
