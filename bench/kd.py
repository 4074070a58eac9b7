"""Distillation benchmarks (method=kd), ratios measured in one run.

1. Peak memory of the KD loss + backward at vocabulary 32k: chunked (``chunked_head_kd``: lm heads applied per
   chunk of tokens, each chunk's gradient computed at once) against naive (full fp32 logits of both models, then
   ``kd_loss``). Measured above the inputs (hidden states, heads): CUDA max_memory_allocated, or on CPU the peak
   RSS of a fresh subprocess per variant. Target: chunked / naive <= 0.35.
2. One KD step (teacher forward without gradients + student forward/backward + chunked loss, ``KDModule.kd_sums``)
   against the teacher forward (logits) and a student forward/backward with the causal-LM loss run separately.
   Models: a random Qwen3-MoE teacher and a dense Qwen3 student of the same width (vocabulary 32k), at each of
   --layers (e.g. ``--layers 4 8 16``: the 32k head's share of the step's FLOPs shrinks with depth; real MoE ->
   dense students have 24-48 layers), the head's share of the nominal FLOPs printed with each. Minimum of
   --reps alternating repetitions. Target: KD / (teacher + student) <= 1.1. Timed with the written-out forward-KL
   gradient (the default, ``analytic_grad``), with autograd through the fp32 KL passes (unless
   --skip-autograd), and with ``--before FILE``: the ``chunked_head_kd`` of another copy of
   moe_lab/distill/losses.py (e.g. ``git show <rev>:moe_lab/distill/losses.py > /tmp/old.py``), same run.
3. The chunked KD loss + backward alone (hidden states -> heads -> loss), analytic against autograd gradient.

The load average is printed before and after (the CPU may be shared: prefer ``--clock process``).

    python bench/kd.py [--tokens 4096] [--hidden 512] [--layers 2 [8 ...]] [--vocab 32000] [--chunk 1024]
        [--device cpu|cuda] [--clock wall|process] [--skip-memory] [--skip-time] [--skip-autograd] [--before F]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time

import torch
import transformers

from moe_lab.distill import chunked_head_kd, kd_loss

CLOCK = [time.perf_counter]  # --clock process: this process's CPU time (robust to other jobs on a shared CPU)


def _inputs(args, device):
    torch.manual_seed(0)
    h_s = torch.randn(args.tokens, args.hidden, device=device, requires_grad=True)
    h_t = torch.randn(args.tokens, args.hidden, device=device)
    head_s = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device)
    head_t = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device).requires_grad_(False)
    return h_s, h_t, head_s, head_t


def _loss(variant, args, h_s, h_t, head_s, head_t):
    if variant == "naive":
        return kd_loss(head_s(h_s), head_t(h_t))
    loss, _, _, _ = chunked_head_kd(h_s, h_t, head_s, head_t, chunk_size=args.chunk)
    return loss / args.tokens


def memory_child(args) -> None:
    """One variant in this process; prints its peak memory above the inputs in MiB."""
    device = torch.device(args.device)
    inputs = _inputs(args, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _loss(args.variant, args, *inputs).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(json.dumps({"peak_mib": peak / 2**20}))


def memory(args) -> dict:
    out = {}
    for variant in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--child", "--variant", variant, "--tokens", str(args.tokens), "--hidden",
               str(args.hidden), "--vocab", str(args.vocab), "--chunk", str(args.chunk), "--device", args.device]
        out[variant] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["peak_mib"]
    return out


def _models(args, device, layers: int):
    common = {"vocab_size": args.vocab, "hidden_size": args.hidden, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": args.hidden // 8, "num_hidden_layers": layers,
              "max_position_embeddings": args.tokens}
    teacher_cfg = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=args.hidden // 2, num_experts=16,
                                              num_experts_per_tok=4, intermediate_size=2 * args.hidden)
    student_cfg = transformers.Qwen3Config(**common, intermediate_size=2 * args.hidden)
    torch.manual_seed(0)
    teacher = transformers.AutoModelForCausalLM.from_config(teacher_cfg).to(device).eval()
    student = transformers.AutoModelForCausalLM.from_config(student_cfg).to(device).train()
    return teacher, student


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def head_share(args, teacher_cfg, student_cfg) -> float:
    """The lm heads' share of the nominal FLOPs of one KD step (matmuls: 2 per weight and token forward, 6
    forward + backward; attention scores 2 x 2 x T/2 x width per token and layer, causal)."""
    h, v, t = args.hidden, args.vocab, args.tokens // args.batch
    q, kv = teacher_cfg.num_attention_heads * teacher_cfg.head_dim, teacher_cfg.num_key_value_heads * teacher_cfg.head_dim
    attn, scores = 2 * h * q + 2 * h * kv, 2 * t * q
    experts = teacher_cfg.num_experts_per_tok * 3 * h * teacher_cfg.moe_intermediate_size + h * teacher_cfg.num_experts
    teacher = 2 * (attn + experts) + scores
    student = 3 * (2 * (attn + 3 * h * student_cfg.intermediate_size) + scores)
    head = 2 * h * v + 6 * h * v
    return head / (head + teacher_cfg.num_hidden_layers * teacher + student_cfg.num_hidden_layers * student)


def step_time(args, layers: int, before=None) -> dict:
    """Minimum over --reps (order rotated per rep) of each KD step variant and the separate teacher + student
    step, after one untimed warm-up step of each."""
    import moe_lab.methods.distill as md
    from moe_lab.methods.distill import KDModule

    device = torch.device(args.device)
    teacher, student = _models(args, device, layers)
    module = KDModule(student, teacher=teacher, options={"chunk_size": args.chunk})
    ids = torch.randint(3, args.vocab, (args.batch, args.tokens // args.batch), device=device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def kd_with(loss_fn=None):
        def run():
            original = md.chunked_head_kd
            md.chunked_head_kd = loss_fn or original
            try:
                module.kd_sums(batch)["loss"].backward()
            finally:
                md.chunked_head_kd = original
        return run

    def separate():
        with torch.no_grad():
            teacher(input_ids=ids, attention_mask=batch["attention_mask"]).logits.float()
        student(**batch).loss.backward()

    fns = {"kd": kd_with()}
    if not args.skip_autograd:
        fns["kd_autograd"] = kd_with(functools.partial(md.chunked_head_kd, analytic_grad=False))
    if before is not None:
        fns["kd_before"] = kd_with(before.chunked_head_kd)
    fns["separate"] = separate
    for fn in fns.values():  # warm-up: first-call costs (kernel selection, caches) are not the step's
        student.zero_grad(set_to_none=True)
        fn()
    best = dict.fromkeys(fns, float("inf"))
    names = list(fns)
    for rep in range(args.reps):  # the order rotates: each variant follows each other one (allocator state)
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fn = fns[name]
            student.zero_grad(set_to_none=True)
            _sync(device)
            start = CLOCK[0]()
            fn()
            _sync(device)
            best[name] = min(best[name], CLOCK[0]() - start)
    best["head_share"] = head_share(args, teacher.config, student.config)
    return best


def head_time(args) -> dict:
    """Minimum over --reps of the chunked KD loss + backward, analytic vs autograd gradient."""
    device = torch.device(args.device)
    h_s, h_t, head_s, head_t = _inputs(args, device)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(args.reps):
        for analytic in (True, False):
            h_s.grad, head_s.weight.grad = None, None
            _sync(device)
            start = CLOCK[0]()
            chunked_head_kd(h_s, h_t, head_s, head_t, chunk_size=args.chunk, analytic_grad=analytic)[0].backward()
            _sync(device)
            best[analytic] = min(best[analytic], CLOCK[0]() - start)
    return {"analytic": best[True], "autograd": best[False]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, nargs="+", default=[2])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="chunked", help=argparse.SUPPRESS)
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall")
    parser.add_argument("--skip-autograd", action="store_true", help="KD step: skip the autograd-gradient variant")
    parser.add_argument("--before", help="KD step: also time chunked_head_kd from this copy of losses.py")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "process":
        CLOCK[0] = time.process_time
    if args.child:
        return memory_child(args)
    print(f"load average (1/5/15 min) at the start: {_load()}, {os.cpu_count()} CPUs, {args.threads} threads")
    if not args.skip_memory:
        mem = memory(args)
        print(f"KD loss+backward peak memory, {args.tokens} tokens x vocab {args.vocab} ({args.device}): naive "
              f"{mem['naive']:.0f} MiB, chunked ({args.chunk}) {mem['chunked']:.0f} MiB, ratio "
              f"{mem['chunked'] / mem['naive']:.3f} (target <= 0.35)")
    if not args.skip_time:
        h = head_time(args)
        print(f"chunked KD loss+backward, {args.tokens} tokens x vocab {args.vocab}: analytic gradient "
              f"{h['analytic'] * 1e3:.0f} ms vs autograd {h['autograd'] * 1e3:.0f} ms: ratio "
              f"{h['analytic'] / h['autograd']:.3f}")
        before = None
        if args.before:
            spec = importlib.util.spec_from_file_location("kd_before", args.before)
            before = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(before)
        labels = {"kd": "analytic gradient", "kd_autograd": "autograd gradient",
                  "kd_before": f"--before {args.before}"}
        for layers in args.layers:
            t = step_time(args, layers, before)
            print(f"KD step, {args.tokens} tokens, hidden {args.hidden}, {layers} layers (lm heads "
                  f"{100 * t['head_share']:.0f}% of the nominal FLOPs), min of {args.reps} reps, "
                  f"{args.clock} clock: teacher forward + student forward/backward {t['separate'] * 1e3:.0f} ms")
            for name, label in labels.items():
                if name in t:
                    print(f"    KD, {label}: {t[name] * 1e3:.0f} ms: ratio {t[name] / t['separate']:.3f} "
                          "(target <= 1.1)")
    print(f"load average (1/5/15 min) at the end: {_load()}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
