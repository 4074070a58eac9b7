"""``method.master_weights=optimizer`` against ``fp32``: one moe-lab sft step under bf16 autocast, each way.

``fp32`` (the default) trains fp32 parameters, so autocast (and moe-lab, for the packed expert tensors) casts every
trained weight to bf16 on every forward. ``optimizer`` keeps the weights in bf16 and lets the optimizer step fp32
copies (:mod:`moe_lab.runtime.optimizer_masters`). Steps of the two are interleaved and the medians compared, so
machine noise hits both alike. Prints ``step_ratio`` (optimizer / fp32) and ``state_ratio``: the bytes of weights,
gradients, masters and AdamW state held after a step, the same ratio. On a CPU the bf16 matmuls themselves dominate,
so the step ratio here says little about a GPU's (bench/mfu.py's ``sft_bf16_compute`` row measures that).

    python bench/master_weights.py [--steps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import transformers
from sft_step import (  # bench/ is on sys.path when run as `python bench/master_weights.py`
    BENCH_CONFIG,
    autocast_step,
)

import moe_lab
from moe_lab.runtime.optimizer_masters import FP32MasterCopies


def build(base, mode: str):
    """(model, optimizer, masters or None) for ``mode`` (fp32 | optimizer), from the bf16 ``base``."""
    model = copy.deepcopy(base).train()
    moe_lab.apply(model, "sft")
    if mode == "fp32":
        for p in model.parameters():
            p.data = p.data.float()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return model, optimizer, FP32MasterCopies(optimizer) if mode == "optimizer" else None


def step(model, optimizer, masters, batch) -> float:
    start = time.perf_counter()
    autocast_step(model, optimizer, batch, "cpu", masters)
    return time.perf_counter() - start


def state_bytes(model, optimizer) -> int:
    """Weights, optimizer parameters (the masters) and AdamW state, in bytes (each tensor counted once)."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"]),
               *(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(transformers.OlmoeConfig(**BENCH_CONFIG)).to(torch.bfloat16)
    ids = torch.randint(0, BENCH_CONFIG["vocab_size"], (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    runs = {mode: build(base, mode) for mode in ("fp32", "optimizer")}
    times = {mode: [] for mode in runs}
    for i in range(args.warmup + args.steps):
        for mode, (model, optimizer, masters) in runs.items():
            seconds = step(model, optimizer, masters, batch)
            if i >= args.warmup:
                times[mode].append(seconds)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    state = {mode: state_bytes(model, optimizer) for mode, (model, optimizer, _) in runs.items()}
    print(f"bench=master_weights torch={torch.__version__} threads={args.threads} batch={args.batch}x{args.seq} "
          f"config=olmoe(h{BENCH_CONFIG['hidden_size']},E{BENCH_CONFIG['num_experts']},k"
          f"{BENCH_CONFIG['num_experts_per_tok']},L{BENCH_CONFIG['num_hidden_layers']}) steps={args.steps}")
    print(f"step_ratio={median['optimizer'] / median['fp32']:.3f} state_ratio={state['optimizer'] / state['fp32']:.3f} "
          f"(optimizer / fp32: bf16 weights + fp32 masters against fp32 weights)")
    return median, state


if __name__ == "__main__":
    main()
