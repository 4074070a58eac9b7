"""Compression benchmarks, ratios measured in one run.

1. Calibration pass (all section-1 statistics, every MoE layer, one forward) against ONE dense all-expert forward
   over the same tokens: the same model forward with every routed expert evaluated on every token of every MoE
   layer (same token chunks), outputs discarded. Target: calibration / dense <= 1.3. Peak memory of each phase
   is reported (CUDA: max_memory_allocated; CPU: the process peak RSS after each phase; plus the planned fp32
   block).
   Model: a random Qwen3-MoE (default E=64, k=8, H=512, I=256, 2 layers, 2048 tokens; the Gram matrix then costs
   E / (3 I) ~ 8% of the dense expert FLOPs, close to Qwen3-30B-A3B's 5.5%).
   The two are run alternately --reps times and the minima compared, wall and process CPU time (the machine
   may be shared; --threads 1 is the steadiest there).
2. D-optimal greedy with incremental Cholesky/Schur updates against the naive greedy that recomputes
   log det(K_S + lambda I) for every candidate, E = 128, K = 64 (same order checked). Target: >= 20x.

3. One-process 350-point pre-distillation sweep (7 scores x 5 groupings x 2 scalings x 5 K) of tiny_qwen3_moe from
   one calibration file against the same points as separate model loads + conversions (extrapolated from
   --sweep-baseline-points of them). Target: >= 10x.

    python bench/compress.py [--reps 3] [--threads 2] [--device cpu|cuda] [--tokens 2048] [--sweep-only]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import transformers

from moe_lab.compress import calibrate, dopt
from moe_lab.compress.calibration import chunk_size
from moe_lab.moe.experts import expert_forward
from moe_lab.moe.view import find_moe_layers


def bench_model(args) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden, moe_intermediate_size=args.inter,
        num_experts=args.experts, num_experts_per_tok=args.top_k, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8, max_position_embeddings=4096,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(args.device)


def dense_forward(model, batches, chunk_tokens: int) -> None:
    """Model forward + every routed expert on every token of every MoE layer (outputs discarded)."""
    views = find_moe_layers(model)

    def make_hook(view):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            for start in range(0, x.shape[0], chunk_tokens):
                xs = x[start:start + chunk_tokens]
                for e in range(view.num_experts):
                    expert_forward(view, e, xs)
        return hook

    hooks = [v.block.register_forward_pre_hook(make_hook(v)) for v in views]
    try:
        with torch.no_grad():
            for b in batches:
                model.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
    finally:
        for h in hooks:
            h.remove()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def peak_mib(device) -> float:
    """Peak memory so far: CUDA max_memory_allocated, or the process peak RSS on CPU (MiB)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn, device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def bench_calibration(args) -> float:
    model = bench_model(args)
    gen = torch.Generator().manual_seed(0)
    seqs = args.tokens // args.seq_len
    ids = torch.randint(0, 1024, (seqs, args.seq_len), generator=gen).to(args.device)
    batches = [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in ids.split(args.batch)]
    view = find_moe_layers(model)[0]
    chunk = chunk_size(view, args.chunk, args.budget_mb)
    block_mib = view.num_experts * chunk * args.hidden * 4 / 2**20

    def dense():
        dense_forward(model, batches, chunk)

    def calib():
        calibrate(model, batches, max_chunk_tokens=args.chunk, memory_budget_mb=args.budget_mb)

    def both(fn):  # (wall s, process CPU s): CPU time is less sensitive to other jobs on a shared machine
        cpu = time.process_time()
        wall = timed(fn, args.device)
        return wall, time.process_time() - cpu

    # peak memory: the dense phase first, then the calibration phase (a process peak only grows)
    m_model = peak_mib(args.device)
    dense_runs = [both(dense)]
    m_dense = peak_mib(args.device)
    cal_runs = [both(calib)]
    m_cal = peak_mib(args.device)
    for _ in range(args.reps):  # alternate the two so that machine load affects both alike; keep the minima
        dense_runs.append(both(dense))
        cal_runs.append(both(calib))
    (w_dense, c_dense), (w_cal, c_cal) = ([min(col) for col in zip(*runs[1:])] for runs in (dense_runs, cal_runs))
    kind = "max_memory_allocated" if args.device == "cuda" else "process peak RSS"
    print(f"calibration: E={args.experts} k={args.top_k} H={args.hidden} I={args.inter} layers={args.layers}, "
          f"{seqs * args.seq_len} tokens in {len(batches)} batches, chunk {chunk} tokens (planned fp32 block "
          f"{block_mib:.1f} MiB), {args.device}, {torch.get_num_threads()} threads, min of {args.reps} alternating runs")
    print(f"  dense all-expert forward {w_dense:.3f} s wall / {c_dense:.3f} s CPU, calibration pass {w_cal:.3f} s "
          f"wall / {c_cal:.3f} s CPU")
    print(f"  {kind}: model {m_model:.0f} MiB, after dense phase {m_dense:.0f} MiB, after calibration phase "
          f"{m_cal:.0f} MiB")
    ratio = w_cal / w_dense
    print(f"  ratio calibration / dense forward = {ratio:.2f}x wall, {c_cal / c_dense:.2f}x CPU time (target <= 1.3)")
    return ratio


def bench_dopt(args) -> float:
    E, K = 128, 64
    gen = torch.Generator().manual_seed(0)
    outputs = torch.randn(E, 256, generator=gen, dtype=torch.float64)
    importance = torch.rand(E, generator=gen, dtype=torch.float64)
    kern = dopt.kernel(importance, outputs @ outputs.T / 256)
    fast_res = dopt.greedy(kern, K)
    t_fast = min(timed(lambda: dopt.greedy(kern, K), "cpu") for _ in range(max(args.reps, 5)))
    t0 = time.perf_counter()
    slow_res = dopt.naive_greedy(kern, K)
    t_slow = time.perf_counter() - t0
    assert fast_res.order == slow_res.order, "incremental and naive greedy disagree"
    speedup = t_slow / t_fast
    print(f"D-optimal greedy E={E} K={K}: Schur updates {t_fast * 1e3:.2f} ms, naive log-det recomputation "
          f"{t_slow * 1e3:.0f} ms, same order; speedup = {speedup:.0f}x (target >= 20)")
    return speedup


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--budget-mb", type=float, default=512)
    parser.add_argument("--sweep-tokens", type=int, default=256, help="perplexity tokens per sweep point")
    parser.add_argument("--sweep-only", action="store_true", help="run only the 350-point sweep benchmark (3.)")
    parser.add_argument("--sweep-baseline-points", type=int, default=4,
                        help="separate load + conversion runs timed for the sweep baseline (extrapolated to 350)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.sweep_only:
        bench_calibration(args)
        bench_dopt(args)
    bench_sweep(args)


# 3. One-process pre-distillation sweep (surgery helper) ------------------------------------------------------


def bench_sweep(args) -> float:
    """350-point sweep (7 scores x 5 groupings x 2 scalings x K in {2,3,4,6,8}) of tiny_qwen3_moe from ONE
    calibration file in one process (``dense_sweep``: one model load, one student skeleton, FFNs rewritten per
    point) against the same points done as separate runs: load the model and the calibration file, ``to_dense``
    (a new student), the same perplexity. The separate runs are timed on ``--sweep-baseline-points`` points
    (different scores/groupings) in this process (no interpreter start-up counted) and extrapolated to 350;
    a separate ``python run.py task=compress`` process per point (what ``-m`` costs with a process-per-job
    launcher) is timed once and reported as well. Target: >= 10x over the in-process separate runs."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from omegaconf import OmegaConf

    from moe_lab.compress import Calibration, to_dense
    from moe_lab.data.collate import encode_prompt
    from moe_lab.models import build_config
    from moe_lab.moe.view import find_moe_layers  # noqa: F401 - same import cost on both sides
    from moe_lab.runs.compress_sweep import PAPER_SCORES, dense_sweep, ppl_point

    root = Path(__file__).resolve().parents[1]
    cfg = OmegaConf.load(root / "conf/model/tiny_qwen3_moe.yaml")
    from moe_lab.data.tokenizer import load_tokenizer

    tok = load_tokenizer("byte")
    text = (root / "README.md").read_text()[:4000]
    ids = encode_prompt(tok, text)[: args.sweep_tokens]
    ppl = {"max_length": 256, "stride": 256}
    Ks = [2, 3, 4, 6, 8]
    groupings, scalings = ["rr", "wc", "rc", "ab", "oc"], ["uniform", "proportional"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        teacher = transformers.AutoModelForCausalLM.from_config(build_config(cfg.config_class, cfg.config)).eval()
        teacher.save_pretrained(tmp / "teacher")
        teacher = transformers.AutoModelForCausalLM.from_pretrained(tmp / "teacher").eval()  # its name_or_path
        gen = torch.Generator().manual_seed(0)
        batches = [{"input_ids": b, "attention_mask": torch.ones_like(b)}
                   for b in torch.randint(3, 300, (16, 128), generator=gen).split(4)]
        calibrate(teacher, batches).save(tmp / "cal.safetensors")
        (tmp / "text.txt").write_text(tok.decode(ids))

        def load():
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "teacher").eval()
            return model, Calibration.load(tmp / "cal.safetensors")

        start = time.perf_counter()
        model, cal = load()
        points = dense_sweep(model, tok, cal, ids, scores=PAPER_SCORES, groupings=groupings, scalings=scalings,
                             Ks=Ks, **ppl)
        t_sweep = time.perf_counter() - start
        n = len(points)
        picks = [(PAPER_SCORES[i % 7], groupings[(2 * i + 1) % 5], scalings[i % 2], Ks[(i + 2) % 5])
                 for i in range(args.sweep_baseline_points)]
        times = []
        for score, grouping, scaling, K in picks:
            t0 = time.perf_counter()
            m, c = load()
            student = to_dense(m, c, score=score, grouping=grouping, scaling=scaling, K=K)
            value = ppl_point(student, tok, ids, **ppl)["ppl"]
            times.append(time.perf_counter() - t0)
            row = points[(points.score == score) & (points.grouping == grouping) & (points.scaling == scaling)
                         & (points.K == K)]
            assert float(row.ppl.iloc[0]) == value, "sweep point differs from a separate conversion"
        per_point = sum(times) / len(times)
        command = [sys.executable, str(root / "run.py"), "task=compress", "model=tiny_qwen3_moe",
                   f"model.pretrained={tmp / 'teacher'}", f"compress.calibration_file={tmp / 'cal.safetensors'}",
                   f"compress.eval.path={tmp / 'text.txt'}", "compress.eval.max_length=256", "compress.eval.stride=256",
                   "compress.export=false", "logger=none", f"hydra.sweep.dir={tmp / 'multi'}"]

        def run(*overrides) -> float:
            t0 = time.perf_counter()
            flags = [o for o in overrides if o == "-m"]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}  # the same thread count as this process
            subprocess.run(command[:2] + flags + command[2:] + [o for o in overrides if o != "-m"], check=True,
                           capture_output=True, cwd=root, env=env)
            return time.perf_counter() - t0

        t_process = run("compress.score=acp", "compress.K=4", f"hydra.run.dir={tmp / 'run'}")
        # Hydra -m with the basic launcher: jobs run one after another in one process, each loading the model and
        # the calibration file and converting; a job's own wall time (its summary.json, from model load to the
        # end) is averaged over the jobs after the first
        run("-m", "compress.score=sf,acp", "compress.K=2,4,8")
        import json

        jobs = sorted((tmp / "multi").glob("*/summary.json"), key=lambda p: int(p.parent.name.split("_")[0]))
        t_job = sum(json.loads(p.read_text())["wall_time_s"] for p in jobs[1:]) / max(len(jobs) - 1, 1)
    ratio = per_point * n / t_sweep
    print(f"sweep: tiny_qwen3_moe (E=8, k=2), {n} points (7 scores x 5 groupings x 2 scalings x K {Ks}), "
          f"{len(ids)} eval tokens, {torch.get_num_threads()} threads, {int((points.status != 'ok').sum())} failed")
    print(f"  one process: {t_sweep:.1f} s ({t_sweep / n * 1e3:.0f} ms/point, incl. the one model + calibration load)")
    print(f"  separate load + to_dense + ppl: {per_point * 1e3:.0f} ms/point (mean of {len(times)}, same ppl) -> "
          f"{per_point * n:.1f} s for {n}")
    print(f"  `python run.py -m task=compress ...` (basic launcher, one process): {t_job:.2f} s per job -> "
          f"{t_job * n:.0f} s ({t_job * n / t_sweep:.0f}x)")
    print(f"  separate `python run.py task=compress` process: {t_process:.1f} s/point -> {t_process * n:.0f} s "
          f"({t_process * n / t_sweep:.0f}x)")
    print(f"  ratio separate runs / one-process sweep = {ratio:.1f}x (target >= 10)")
    return ratio


if __name__ == "__main__":
    main()
