"""Compressed Experts paper Tables 3/4, measured: generation latency of Top-k, Top-k/2 and Top-k/2 w/ CE.

NOT YET RUN ON A GPU: no latency from this script has been recorded (docs/results.md, Benchmarks, says so until one
is); every run prints that line until ``GPU_RUN`` names one. It has been run only on CPU at tiny width
(tests/analysis/test_compressed_experts_latency_bench.py), which checks the flow, not the times.

Protocol (paper section 3.1, "Inference latency evaluation", after the latency benchmark of Kwon et al. 2023):
dummy prompts of batch 8 and sequence length 32 made of random token ids; the model generates their completions;
10 warm-up iterations, then the latency averaged over 30 iterations. Not stated: how many tokens are generated
(``--new-tokens``, default 128: the cited benchmark's default output length) and whether decoding stops at an end
token (here never: ``min_new_tokens = max_new_tokens``, so every iteration does the same work), greedy. Rows:
- Top-k SFT (``sft``): the model as it is;
- Top-k/2 SFT (``sft_topk_half``): ``num_experts_per_tok`` halved (k 8 -> 4 for OLMoE, 2 -> 1 for Phi-3.5-MoE);
- Top-k/2 SFT w/ CE (``compressed_experts``): method=compressed_experts, k_main = k/2, the vectors at their
  initial ones (the latency does not depend on their values).
The paper (A100s; Table 3 Phi-3.5-MoE, Table 4 OLMoE-1B-7B-0924) prints 5.59 / 4.01 / 4.35 s and 7.14 / 5.31 /
5.83 s. ``--out`` writes ``summary.json`` (one ``Latency`` cell per row) for
``python -m experiments.collect compressed_experts <out>``, which prints ours beside the paper's.

    python bench/compressed_experts_latency.py --model olmoe --out bench_ce_latency -- \\
        model.pretrained=/local/OLMoE-1B-7B-0924
    python bench/compressed_experts_latency.py --model tiny_olmoe --paper-model olmoe --warmup 1 --iterations 2 \\
        --new-tokens 4   # CPU smoke test at tiny width
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
GPU_RUN = None  # "<date>, <GPU>": set when a GPU measurement of this script is recorded in docs/results.md
ROWS = ("sft", "sft_topk_half", "compressed_experts")
PAPER = {"phimoe": {"sft": 5.59, "sft_topk_half": 4.01, "compressed_experts": 4.35},  # Table 3, s
         "olmoe": {"sft": 7.14, "sft_topk_half": 5.31, "compressed_experts": 5.83}}  # Table 4, s


def model_config(model: str, overrides: list[str]):
    """The ``conf/model/<model>`` entry composed with ``overrides`` (``model.pretrained=...``)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"model={model}", *overrides]).model


def build_row(row: str, model_cfg, device: str) -> torch.nn.Module:
    """The model of one row: as loaded (sft), with half of its top-k (sft_topk_half), or with compressed experts on
    half of its top-k (compressed_experts)."""
    from omegaconf import OmegaConf

    import moe_lab
    from moe_lab.models import load_model

    if row not in ROWS:
        raise ValueError(f"row {row!r}: choose from {', '.join(ROWS)}")
    cfg = OmegaConf.to_container(model_cfg, resolve=True)
    top_k = top_k_of(cfg)
    if row == "sft_topk_half":
        cfg["config"] = {**(cfg.get("config") or {}), "num_experts_per_tok": top_k // 2}
    model, _ = load_model(cfg)
    if row == "compressed_experts":
        moe_lab.apply(model, "compressed_experts", k_main=top_k // 2)
    return model.to(device).eval()


def top_k_of(cfg: dict) -> int:
    """The model's experts per token: its ``config`` override, else its typed-in ``architecture``."""
    for node in (cfg.get("config") or {}, cfg.get("architecture") or {}):
        if node.get("num_experts_per_tok") is not None:
            return int(node["num_experts_per_tok"])
    raise ValueError("model: neither model.config nor model.architecture gives num_experts_per_tok")


def timed_iterations(step, warmup: int, iterations: int, device: str) -> list[float]:
    """Run ``step`` ``warmup`` times untimed, then ``iterations`` times; the wall seconds of each timed one."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iterations):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def measure(model: torch.nn.Module, args, device: str) -> list[float]:
    """Seconds per iteration: ``--batch`` x ``--seq`` random prompt ids, ``--new-tokens`` generated greedily."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    @torch.no_grad()
    def step():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)

    return timed_iterations(step, args.warmup, args.iterations, device)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmoe", help="a conf/model entry (olmoe, phimoe; tiny_olmoe on CPU)")
    parser.add_argument("--paper-model", default=None, choices=sorted(PAPER),
                        help="whose paper latencies to print beside ours (default: --model's; a tiny stand-in: olmoe)")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--batch", type=int, default=8)         # paper
    parser.add_argument("--seq", type=int, default=32)          # paper
    parser.add_argument("--warmup", type=int, default=10)       # paper
    parser.add_argument("--iterations", type=int, default=30)   # paper
    parser.add_argument("--new-tokens", type=int, default=128)  # not stated: the cited benchmark's default
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write summary.json here (python -m experiments.collect)")
    parser.add_argument("overrides", nargs="*", help="conf/model overrides after --, e.g. model.pretrained=...")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    model_cfg = model_config(args.model, args.overrides)
    gpu = args.device.startswith("cuda")
    name = torch.cuda.get_device_name(0) if gpu else "cpu"
    print(f"bench=compressed_experts_latency model={args.model} device={name} batch={args.batch} seq={args.seq} "
          f"warmup={args.warmup} iterations={args.iterations} new_tokens={args.new_tokens}")
    if GPU_RUN is None:
        print("not yet run on a GPU: no latency of this script is recorded (docs/results.md); "
              + ("this is the first GPU run: record it" if gpu else "a CPU run checks the flow, not the times"))
    paper, cells = PAPER.get(args.paper_model or args.model, {}), []
    for row in args.rows.split(","):
        model = build_row(row, model_cfg, args.device)
        times = measure(model, args, args.device)
        mean = statistics.fmean(times)
        std = statistics.stdev(times) if len(times) > 1 else 0.0
        print(f"row={row} latency_s={mean:.3f} std={std:.3f} paper_s={paper.get(row, 'n/a')}", flush=True)
        cells.append({"model": args.model, "method": row, "column": "Latency", "value": mean, "averaged": False})
        del model
        if gpu:
            torch.cuda.empty_cache()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({
            "table": cells, "columns": ["Latency"], "limit": None, "device": name,
            "protocol": {k: getattr(args, k) for k in ("batch", "seq", "warmup", "iterations", "new_tokens")}},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
