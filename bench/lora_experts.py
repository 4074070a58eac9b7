"""Expert LoRA split (x A B on the routed rows) against merged (W + scale B A materialised per forward): one
training step's time and memory, measured in one run, printed as ratios.

Each variant runs in its own child process (so peak memory is its own): an OLMoE-shaped MoE layer stack (expert
widths of OLMoE-1B-7B by default: E = 64, top-8, hidden 2048, expert width 1024; ``--layers`` decoder layers, a
small vocabulary so the embedding does not dominate), ``moe_lab.apply(model, "sft", lora={targets: [experts],
rank, experts: split | merged})``, ``--warmup`` then ``--steps`` forward + backward steps of ``--tokens`` tokens.
Reported per variant: median step time, the child's peak resident memory (``ru_maxrss``) and what autograd holds
between forward and backward (the bytes of every tensor saved for backward that is not a parameter, once per
storage). The
merged form computes the [E, 2I, H] and [E, H, I] deltas B A in the forward (and holds W + scale B A for the
backward) and their full-size gradients in the backward; the split form never does.

    python bench/lora_experts.py                      # OLMoE expert widths, 1 layer, 512 tokens, rank 16
    python bench/lora_experts.py --hidden 256 --intermediate 128 --tokens 128   # a quick look
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def _saved_bytes(model, batch) -> tuple[torch.Tensor, int]:
    """The loss of one forward, and the bytes autograd saved for its backward beyond the parameters themselves
    (each storage once; a saved weight that IS a parameter costs nothing extra, a merged W + scale B A does)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    return loss, sum(seen.values())


def child(args) -> dict:
    """One variant: build, adapt, time ``args.steps`` steps (after ``args.warmup``), report."""
    from transformers import AutoModelForCausalLM, OlmoeConfig

    import moe_lab

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = OlmoeConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                         num_experts=args.experts, num_experts_per_tok=args.top_k, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config).train()
    moe_lab.apply(model, "sft", lora={"rank": args.rank, "alpha": 2 * args.rank, "targets": ["experts"],
                                      "experts": args.variant})
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))
    batch = {"input_ids": ids, "labels": ids}
    times, saved = [], 0
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss, saved = _saved_bytes(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "saved_mb": saved / 2**20}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", choices=("split", "merged"), help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(child(args)))
        return
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    rows = {}
    for variant in ("merged", "split"):
        out = subprocess.run([sys.executable, __file__, *forwarded, "--variant", variant], capture_output=True,
                             text=True, check=True).stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
    print(f"expert LoRA, {args.layers} layer(s), E={args.experts} top-{args.top_k}, hidden {args.hidden}, expert width "
          f"{args.intermediate}, {args.tokens} tokens, rank {args.rank}, torch {torch.__version__}, "
          f"{args.threads} CPU threads" if not torch.cuda.is_available() else "")
    print(f"{'variant':8} {'step s':>8} {'peak RSS MB':>12} {'saved for backward MB':>22}")
    for variant, row in rows.items():
        print(f"{variant:8} {row['step_s']:8.3f} {row['peak_rss_mb']:12.0f} {row['saved_mb']:22.1f}")
    m, s = rows["merged"], rows["split"]
    print(f"split / merged: step time {s['step_s'] / m['step_s']:.2f}, peak RSS {s['peak_rss_mb'] / m['peak_rss_mb']:.2f}, "
          f"saved for backward {s['saved_mb'] / m['saved_mb']:.2f}")


if __name__ == "__main__":
    main()
