"""Condenser paper Table 4, measured: post-training seconds per 10 iterations under DeepSpeed offload.

NOT YET RUN ON A GPU: no timing from this script has been recorded; docs/results.md (Benchmarks) says so until one
is. It has been run only on CPU with a tiny model (tests/analysis/test_offload_bench.py), which checks the flow, not the times.

Protocol (paper section 5.3 and Table 4): DenseMixer, SFT and ExpertCondenser each post-train DeepSeek-V2-Lite
with a global batch of 32 under DeepSpeed offload. Each run does 50 warm-up iterations, then 300 timed ones. The
table reports the mean time of 10 iterations over those 300, and the speed-up against DenseMixer. An iteration
is one optimizer step. The paper ran on 8 x H100 80GB over PCIe Gen4: DenseMixer 362.83 s (1x), SFT 152.78 s
(2.37x), ExpertCondenser 126.24 s (2.87x).

Each method is one ``python run.py task=finetune`` subprocess on the same model, data and hardware, plus this
file's ``IterationTimer`` callback (``bench/`` goes on PYTHONPATH). The callback CUDA-synchronises and writes
the wall time at the end of every optimizer step. Validation, observability callbacks and loggers are off.
``--offload`` picks the DeepSpeed setting:
- ``optimizer`` (default): ZeRO-2 with optimizer state and gradients on the CPU (``hardware=deepspeed_zero2
  hardware.trainer.strategy.offload_optimizer=true``).
- ``parameters``: ZeRO-3 with parameters and optimizer offloaded (``hardware=deepspeed_zero3_offload``), the
  paper's "parameter offloading". DenseMixer's inactive-expert pass runs inside ZeRO-3's gathered scope
  (tests/runtime/test_sharded_densemixer.py), so all three rows run under both settings; a row a run refuses
  reports the refusal and the speed-ups are taken against SFT.
The condenser run exports its model so ``condenser.json`` can be checked for chosen condensers. A row whose
condensers were never chosen is reported as such, not as ExpertCondenser. The condensers are chosen by the
forward-only pre-phase before step 0 (outside the timed iterations): the run's start line says on how many tokens.

    python bench/offload.py --model deepseek_v2_lite --dataset math7k --gpus 8 -- \\
        model.pretrained=/local/DeepSeek-V2-Lite dataset.path=/local/math_7k.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parent.parent
PAPER = {"densemixer": 362.83, "sft": 152.78, "condenser": 126.24}  # Table 4, s per 10 iterations, 8 x H100
METHODS = ("densemixer", "sft", "condenser")
OFFLOAD = {"optimizer": ["hardware=deepspeed_zero2", "hardware.trainer.strategy.offload_optimizer=true"],
           "parameters": ["hardware=deepspeed_zero3_offload"]}


class IterationTimer(pl.Callback):
    """Wall time (CUDA-synchronised) at the start of training and at the end of every optimizer step, written
    to ``path`` as JSON by global rank 0 when training ends."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.marks: list[float] = []
        self._step = -1

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_start(self, trainer, pl_module):
        self.marks, self._step = [self._now()], trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self._step:  # an optimizer step ended with this micro-batch
            self.marks.append(self._now())
            self._step = trainer.global_step

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"iteration_seconds": durations(self.marks)}))
            tmp.replace(self.path)


def durations(marks: list[float]) -> list[float]:
    """Seconds of each iteration from the start mark and the end marks."""
    return [b - a for a, b in itertools.pairwise(marks)]


def seconds_per_window(seconds: list[float], warmup: int = 50, iterations: int = 300, window: int = 10) -> dict:
    """The paper's measure: after ``warmup`` iterations, the time of every ``window`` consecutive iterations over
    the next ``iterations``; mean and standard deviation of those window times."""
    if iterations % window:
        raise ValueError(f"--iterations={iterations} is not a multiple of --window={window}")
    if len(seconds) < warmup + iterations:
        raise ValueError(f"{len(seconds)} iterations recorded, the protocol needs {warmup} + {iterations}")
    timed = seconds[warmup:warmup + iterations]
    windows = [sum(timed[i:i + window]) for i in range(0, iterations, window)]
    return {"seconds_per_window": statistics.fmean(windows),
            "std": statistics.stdev(windows) if len(windows) > 1 else 0.0, "windows": len(windows)}


def command(method: str, args, run_dir: Path, timer: Path) -> list[str]:
    """The ``run.py`` command line of one row."""
    micro = args.micro_batch
    if args.global_batch % (micro * args.gpus):
        raise ValueError(f"--global-batch={args.global_batch} is not a multiple of --micro-batch={micro} x "
                         f"--gpus={args.gpus}")
    steps = args.warmup + args.iterations
    hardware = ["hardware=cpu"] if args.hardware_cpu else [*OFFLOAD[args.offload], f"hardware.trainer.devices={args.gpus}"]
    return [sys.executable, str(ROOT / "run.py"), "task=finetune", f"model={args.model}", f"method={method}",
            f"dataset={args.dataset}", *hardware, f"dataset.batch_size={micro}",
            f"task.trainer.accumulate_grad_batches={args.global_batch // (micro * args.gpus)}",
            f"task.trainer.max_steps={steps}", "task.trainer.limit_val_batches=0",
            f"task.checkpoint_every_n_steps={steps + 1}", f"task.export={str(method == 'condenser').lower()}",
            "logger=none", "callbacks=none", "+callbacks.iteration_timer._target_=offload.IterationTimer",
            f"+callbacks.iteration_timer.path={timer}", f"hydra.run.dir={run_dir}", *args.overrides]


def condensers_chosen(export: Path) -> bool | None:
    """Whether the condenser export's ``condenser.json`` lists condensers in every layer; None without it."""
    state = export / "condenser.json"
    if not state.is_file():
        return None
    layers = json.loads(state.read_text())["layers"].values()
    return all(layer.get("forced_experts") for layer in layers)


def run_row(method: str, args, out: Path) -> dict:
    run_dir, timer = out / method, out / f"{method}_iterations.json"
    cmd = command(method, args, run_dir, timer)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "bench"), str(ROOT),
                                                                     os.environ.get("PYTHONPATH")]))}
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    (out / f"{method}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return {"method": method, "status": f"failed (exit {proc.returncode}): {last[0]}"}
    row = {"method": method, "status": "ok",
           **seconds_per_window(json.loads(timer.read_text())["iteration_seconds"], args.warmup, args.iterations,
                                args.window)}
    if method == "condenser" and not condensers_chosen(run_dir / "export"):
        row["status"] = "condensers never chosen: this row is not ExpertCondenser"
    return row


def collect_cells(rows: list[dict], model: str, window: int) -> list[dict]:
    """The measured rows as results-table cells for ``python -m experiments.collect condenser <out>`` (reported.csv
    table "Offload timing"): ``Time`` in seconds per 10 iterations, ``Speedup`` against DenseMixer (else SFT)."""
    ok = {r["method"]: r["seconds_per_window"] * 10 / window for r in rows if r["status"] == "ok"}
    reference = "densemixer" if "densemixer" in ok else "sft" if "sft" in ok else None
    cells = []
    for method, seconds in ok.items():
        cells.append({"model": model, "method": method, "column": "Time", "value": seconds, "averaged": False})
        if reference is not None:
            cells.append({"model": model, "method": method, "column": "Speedup", "value": ok[reference] / seconds,
                          "averaged": False})
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek_v2_lite")
    parser.add_argument("--dataset", default="math7k")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--offload", choices=sorted(OFFLOAD), default="optimizer")
    parser.add_argument("--gpus", type=int, default=max(1, torch.cuda.device_count()))
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--out", default="bench_offload")
    parser.add_argument("--hardware-cpu", action="store_true", help="flow check only: hardware=cpu, no DeepSpeed")
    parser.add_argument("overrides", nargs="*", help="extra run.py overrides after --")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_row(m, args, out) for m in args.methods.split(",")]
    ok = {r["method"]: r["seconds_per_window"] for r in rows if r["status"] == "ok"}
    reference = "densemixer" if "densemixer" in ok else "sft" if "sft" in ok else None
    setting = "cpu (flow check)" if args.hardware_cpu else f"{args.offload} offload, {args.gpus} GPU(s)"
    print(f"bench=offload model={args.model} {setting} global_batch={args.global_batch} warmup={args.warmup} "
          f"iterations={args.iterations} window={args.window}")
    for r in rows:
        speedup = ok[reference] / ok[r["method"]] if reference and r["method"] in ok else math.nan
        print(f"method={r['method']} status={r['status']!r} s_per_{args.window}="
              f"{r.get('seconds_per_window', math.nan):.2f} std={r.get('std', math.nan):.2f} "
              f"speedup_vs_{reference}={speedup:.2f} paper_s_per_10={PAPER.get(r['method'], math.nan)}")
    (out / "offload_bench.json").write_text(json.dumps({"setting": setting, "rows": rows}, indent=2))
    cells = collect_cells(rows, args.model, args.window)
    (out / "summary.json").write_text(json.dumps({"table": cells, "columns": ["Time", "Speedup"], "limit": None,
                                                  "setting": setting}, indent=2))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
