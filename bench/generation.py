"""Throughput of batched generation (batch 16, left padding, KV cache) against one prompt at a time.

Same tiny random model (conf/model/tiny_olmoe.yaml, byte tokenizer), same prompts (``--prompts``, default
64: the first GSM8K questions of the LLM-Adapters file in the Alpaca template when the data folder is there,
else synthetic ones of varied lengths), as an evaluation run sees them: ``generate`` sorts them by length
and decodes batches of 16. Greedy, no stop string, so every prompt generates ``--new-tokens`` tokens. The two
modes alternate and the least disturbed wall times (minima over repetitions) are compared; the completions are checked
to be identical. Target: speedup >= 4 at batch 16.

    python bench/generation.py [--reps 3] [--prompts 64] [--new-tokens 64] [--threads 2] [--moe-lab]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import transformers
from omegaconf import OmegaConf

import moe_lab
from moe_lab.data.prompts import format_prompt
from moe_lab.data.shipped import LLM_ADAPTERS_DIR
from moe_lab.data.tokenizer import build_byte_tokenizer
from moe_lab.eval.generation import generate
from moe_lab.models import build_config

ROOT = Path(__file__).resolve().parents[1]
BATCH = 16


def bench_prompts(n: int) -> tuple[list[str], str]:
    path = LLM_ADAPTERS_DIR / "gsm8k.test.json"
    if path.is_file():
        import json

        rows = json.loads(path.read_text(encoding="utf-8"))[:n]
        return [format_prompt(r["instruction"]) for r in rows], "gsm8k(alpaca)"
    return [f"Question {i}: " + "how many apples " * (1 + 3 * (i % 16)) + "\nAnswer:" for i in range(n)], "synthetic"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--moe-lab", action="store_true", help="patch the model with moe_lab.apply first")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = OmegaConf.load(ROOT / "conf" / "model" / "tiny_olmoe.yaml")
    config = build_config(cfg.config_class, cfg.config)
    config.max_position_embeddings = 2048
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if args.moe_lab:
        moe_lab.apply(model)
    tok = build_byte_tokenizer()
    prompts, source = bench_prompts(args.prompts)
    lengths = [len(tok(p)["input_ids"]) for p in prompts]

    def timed(batch: list[str], batch_size: int):
        start = time.perf_counter()
        out = generate(model, tok, batch, max_new_tokens=args.new_tokens, batch_size=batch_size)
        return time.perf_counter() - start, out

    timed(prompts[:BATCH], BATCH)  # warm-up
    batched_times, single_times = [], [[] for _ in prompts]
    for _ in range(args.reps):
        t, batched = timed(prompts, BATCH)
        batched_times.append(t)
        singles = []
        for i, prompt in enumerate(prompts):
            t, out = timed([prompt], 1)
            single_times[i].append(t)
            singles += out
        assert singles == batched, "batched and one-at-a-time completions differ"
    # Minimum over repetitions (the least disturbed run), per prompt for one-at-a-time: on a busy machine
    # this is the least noisy estimate, and summing per-prompt minima favours the one-at-a-time side.
    t1, tb = sum(min(ts) for ts in single_times), min(batched_times)
    t1_med = sum(statistics.median(ts) for ts in single_times)
    tb_med = statistics.median(batched_times)
    print(f"bench=generation model=tiny_olmoe{'+moe_lab' if args.moe_lab else ''} prompts={len(prompts)}x{source} "
          f"prompt_tokens={min(lengths)}..{max(lengths)} max_new_tokens={args.new_tokens} reps={args.reps} "
          f"threads={args.threads}")
    print(f"one_at_a_time_s={t1:.3f} batched_s={tb:.3f} (minima over reps; medians {t1_med:.3f} vs {tb_med:.3f}, "
          f"ratio {t1_med / tb_med:.2f})")
    print(f"batch={BATCH} speedup={t1 / tb:.2f} target>=4")


if __name__ == "__main__":
    main()
