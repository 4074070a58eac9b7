"""CD-MoE greedy expert search (docs/specs/compression.md 3.5): cached candidate evaluation against the naive search
that condenses the layer and runs a full model forward per candidate, E = 64, K_r = 6 (369 candidates per
layer), on a tiny but deep random DeepSeek-V2 (2 shared + 64 routed experts, top-6, --layers decoder layers,
layer 0 dense). Target: cached >= 20x faster.

The cached time covers everything a search pays (one capture forward, the 64 expert outputs, 369 weighted sums
+ JS). The naive search runs the first greedy step fully (64 forwards) and, unless --full, is extrapolated to 369
forwards from its measured per-candidate time; both searches' first pick and losses are compared.

    python bench/condense.py [--layers 8] [--seqs 4] [--seq-len 64] [--threads 2] [--full]
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from moe_lab.compress import calibrate
from moe_lab.compress.condense_search import ExpertSearch, candidate_count, capture
from moe_lab.moe.view import find_moe_layers


def build(args) -> torch.nn.Module:
    config = transformers.DeepseekV2Config(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden, moe_intermediate_size=args.inter,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, num_hidden_layers=args.layers,
        first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, head_dim=8, max_position_embeddings=1024, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--inter", type=int, default=64)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--routed", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="run all naive candidates instead of extrapolating")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args)
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(3, 1024, (args.seqs, args.seq_len), generator=gen),
                "attention_mask": torch.ones(args.seqs, args.seq_len, dtype=torch.long)}]
    cal = calibrate(model, batches)
    view = find_moe_layers(model)[0]
    E = view.num_experts
    total = candidate_count(E, args.routed)
    print(f"E={E} K_r={args.routed}: {total} candidate evaluations per layer; model {args.layers} layers, "
          f"{args.seqs}x{args.seq_len} calibration tokens, threads={args.threads}")

    start = time.perf_counter()
    cache = capture(model, batches, [view.index])[view.index]
    fast = ExpertSearch(model, cal, view, cache, batches, cached=True)
    chosen, _ = fast.run(args.routed)
    cached_s = time.perf_counter() - start

    slow = ExpertSearch(model, cal, view, cache, batches, cached=False)
    start = time.perf_counter()
    if args.full:
        slow_chosen, _ = slow.run(args.routed)
        naive_s, measured = time.perf_counter() - start, total
        assert slow_chosen == chosen, (slow_chosen, chosen)
    else:
        first = slow.losses([])
        measured = int(torch.isfinite(first).sum())
        per = (time.perf_counter() - start) / measured
        naive_s = per * total
        ref = fast.losses([])
        assert int(first.argmin()) == chosen[0]
        finite = torch.isfinite(first)
        print(f"first step: max |cached - forward| loss = {float((ref[finite] - first[finite]).abs().max()):.3e}")
    print(f"cached search: {cached_s:.2f} s for {total} candidates (incl. capture + 64 expert outputs); "
          f"order {chosen}")
    print(f"naive search : {naive_s:.2f} s ({'measured' if args.full else f'{measured} measured, extrapolated'})")
    print(f"speed-up: {naive_s / cached_s:.1f}x (target >= 20x)")


if __name__ == "__main__":
    main()
