"""bench/compressed_experts_latency.py (Compressed Experts Tables 3/4's latency protocol): the paper's defaults,
warm-up and timed iterations counted, each row's model (top-k halved; compressed experts on half of the top-k),
and the CPU smoke test at tiny width: the paper's latencies printed beside ours, the not-on-a-GPU line, and
summary.json read by experiments.collect."""

from __future__ import annotations

import json
import sys

from experiments import collect
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import compressed_experts_latency as bench  # bench/compressed_experts_latency.py


def test_defaults_are_the_papers_protocol():
    args = bench.parse([])
    assert (args.batch, args.seq, args.warmup, args.iterations) == (8, 32, 10, 30)  # paper section 3.1
    assert bench.PAPER == {"phimoe": {"sft": 5.59, "sft_topk_half": 4.01, "compressed_experts": 4.35},
                           "olmoe": {"sft": 7.14, "sft_topk_half": 5.31, "compressed_experts": 5.83}}


def test_warmup_untimed_then_timed_iterations():
    calls = []
    times = bench.timed_iterations(lambda: calls.append(1), warmup=3, iterations=5, device="cpu")
    assert len(calls) == 8 and len(times) == 5 and all(t >= 0 for t in times)


def test_rows_halve_the_top_k_or_compress_half_of_it():
    cfg = bench.model_config("tiny_olmoe", [])
    k = bench.top_k_of({"config": dict(cfg.config)})
    full = bench.build_row("sft", cfg, "cpu")
    half = bench.build_row("sft_topk_half", cfg, "cpu")
    ce = bench.build_row("compressed_experts", cfg, "cpu")
    assert (full.config.num_experts_per_tok, half.config.num_experts_per_tok, ce.config.num_experts_per_tok) == \
        (k, k // 2, k)
    policies = [m.moe_lab_policy for m in ce.modules() if hasattr(m, "moe_lab_policy")]
    assert policies and all(p.k_main == k // 2 for p in policies)
    assert not any(hasattr(m, "moe_lab_policy") for m in full.modules())


def test_cpu_smoke_run_prints_the_paper_beside_ours_and_feeds_collect(tmp_path, capsys):
    out = tmp_path / "latency"
    argv = ["--model", "tiny_olmoe", "--paper-model", "olmoe", "--warmup", "1", "--iterations", "2",
            "--new-tokens", "2", "--batch", "2", "--seq", "8", "--out", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "not yet run on a GPU" in printed and "a CPU run checks the flow, not the times" in printed
    rows = {line.split()[0]: line for line in printed.splitlines() if line.startswith("row=")}
    assert set(rows) == {f"row={r}" for r in bench.ROWS}
    assert "paper_s=7.14" in rows["row=sft"] and "paper_s=5.83" in rows["row=compressed_experts"]
    summary = json.loads((out / "summary.json").read_text())
    assert [c["method"] for c in summary["table"]] == list(bench.ROWS) and summary["device"] == "cpu"
    assert collect.main(["compressed_experts", str(out), "--as", "tiny_olmoe=olmoe"]) == 0
    table = [[p.strip() for p in line.split("|")] for line in capsys.readouterr().out.splitlines()
             if line.startswith("| OLMoE")]
    ours = {p[2]: p for p in table if p[4] == "Latency"}
    assert ours["Top-k SFT"][6] == "7.14" and ours["Top-k SFT"][7] != "n/a"
    assert set(ours) == {"Top-k SFT", "Top-k/2 SFT", "Compressed Experts"}
