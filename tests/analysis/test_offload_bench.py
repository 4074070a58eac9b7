"""bench/offload.py (Condenser Table 4's measured protocol): the window arithmetic by hand, each row's run.py
command composed by Hydra under both offload settings, and (slow) the whole flow on CPU with a tiny model."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import offload as bench  # bench/offload.py, under the name run.py's subprocess imports it by


def test_windows_by_hand():
    seconds = [float(s) for s in range(1, 13)]  # warm-up 1, 2; timed 3..12 in windows of 5: 25, 50
    got = bench.seconds_per_window(seconds, warmup=2, iterations=10, window=5)
    assert got == {"seconds_per_window": 37.5, "std": statistics.stdev([25.0, 50.0]), "windows": 2}
    assert bench.durations([10.0, 10.5, 12.0]) == [0.5, 1.5]
    with pytest.raises(ValueError, match="11 iterations recorded, the protocol needs 2 \\+ 10"):
        bench.seconds_per_window(seconds[:11], warmup=2, iterations=10, window=5)
    with pytest.raises(ValueError, match="not a multiple of --window"):
        bench.seconds_per_window(seconds, warmup=2, iterations=10, window=3)


def test_collect_cells_per_ten_iterations_and_speedup():
    """Windows of 5 iterations: 10 s and 4 s per window are 20 s and 8 s per 10 iterations; speed-up against
    DenseMixer 1 and 2.5; a failed row gives no cell; without DenseMixer the speed-up is against SFT."""
    rows = [{"method": "densemixer", "status": "ok", "seconds_per_window": 10.0},
            {"method": "condenser", "status": "ok", "seconds_per_window": 4.0},
            {"method": "sft", "status": "refused", "seconds_per_window": 1.0}]
    cells = {(c["method"], c["column"]): c["value"] for c in bench.collect_cells(rows, "deepseek_v2_lite", 5)}
    assert cells == {("densemixer", "Time"): 20.0, ("densemixer", "Speedup"): 1.0, ("condenser", "Time"): 8.0,
                     ("condenser", "Speedup"): 2.5}
    rows[0]["status"], rows[2]["status"] = "refused", "ok"
    cells = {(c["method"], c["column"]): c["value"] for c in bench.collect_cells(rows, "m", 10)}
    assert cells[("condenser", "Speedup")] == 0.25 and ("densemixer", "Time") not in cells


def _args(**kw):
    base = {"model": "deepseek_v2_lite", "dataset": "math7k", "offload": "optimizer", "gpus": 8, "global_batch": 32,
            "micro_batch": 4, "warmup": 50, "iterations": 300, "window": 10, "hardware_cpu": False, "overrides": []}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("offload", ["optimizer", "parameters"])
def test_commands_compose_the_protocol(tmp_path, offload):
    for method in bench.METHODS:
        cmd = bench.command(method, _args(offload=offload), tmp_path / method, tmp_path / "t.json")
        overrides = [c for c in cmd[2:] if not c.startswith("hydra.")]
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
        strategy = cfg.hardware.trainer.strategy
        assert strategy.stage == (2 if offload == "optimizer" else 3) and strategy.offload_optimizer
        assert strategy.offload_parameters == (offload == "parameters") and cfg.hardware.trainer.devices == 8
        assert cfg.dataset.batch_size * cfg.task.trainer.accumulate_grad_batches * 8 == 32
        assert cfg.task.trainer.max_steps == 350 and cfg.task.export == (method == "condenser")
        assert list(cfg.callbacks) == ["iteration_timer"] and cfg.method.name == method
    with pytest.raises(ValueError, match="--global-batch=32 is not a multiple of --micro-batch=4 x --gpus=3"):
        bench.command("sft", _args(gpus=3), tmp_path, tmp_path / "t.json")


@pytest.mark.slow
def test_flow_on_cpu(tmp_path, capsys):
    """Three tiny runs on CPU: per-iteration times recorded by the callback, the window means printed. The
    condenser row chooses its condensers in the forward-only pre-phase before step 0, so even 3 steps train with
    them and the row is reported (the bench checks the run chose condensers)."""
    out = tmp_path / "bench"
    code = bench.main(["--hardware-cpu", "--model", "tiny_olmoe", "--dataset", "synthetic_math", "--gpus", "1",
                       "--global-batch", "2", "--micro-batch", "2", "--warmup", "1", "--iterations", "2",
                       "--window", "1", "--out", str(out), "--", "dataset.num_examples=40"])
    rows = {r["method"]: r for r in json.loads((out / "offload_bench.json").read_text())["rows"]}
    for method in ("densemixer", "sft", "condenser"):
        assert rows[method]["status"] == "ok" and rows[method]["windows"] == 2, (method, rows[method])
        assert len(json.loads((out / f"{method}_iterations.json").read_text())["iteration_seconds"]) == 3
    assert code == 0
    assert "method=sft status='ok'" in capsys.readouterr().out
    # summary.json for experiments.collect: reported.csv's "Offload timing" cells, ours beside the paper's
    from experiments import collect

    assert collect.main(["condenser", str(out), "--as", "tiny_olmoe=deepseek_v2_lite"]) == 0
    shown = [[c.strip() for c in line.split("|")] for line in capsys.readouterr().out.splitlines()
             if line.startswith("| DeepSeek-V2-Lite")]
    times = {p[2]: p[6:8] for p in shown if p[4] == "Time"}
    assert set(times) == {"DenseMixer", "SFT", "Expert Condenser"} and times["SFT"][0] == "152.78"
    assert all(ours != "n/a" for _, ours in times.values())
