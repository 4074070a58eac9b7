"""Every (preset, row) pair that runs on a DeepSpeed strategy at paper scale also RUNS on its tiny sibling under
that strategy: the preset's own hardware config (ZeRO stage, offload, precision) on DeepSpeed's CPU engine, one
rank (tests/deepspeed_cpu.py lifts Lightning's CUDA-only checks), through ``run.execute`` as ``python run.py`` does,
with the row's method and options, a few steps on local data (tests/test_presets_run.py's sizes); the export is
written and reloads, and the checkpoint says it was written under that stage.

One run per distinct (task, method, ESFT score, LoRA, ZeRO stage, offload, ESFT weight decay: the slices' own
decay on ZeRO's masters) combination, taken from the presets themselves (a new preset row with a new combination
is covered without editing this file): the rows of one combination differ only in numbers (gamma, learning rate,
epochs, the dataset, another method's weight decay, which AdamW applies inside ZeRO's optimizer), which the
strategy does not see, so one representative (the first such row, which also fixes the model family) runs each
code path the sharded run can take. The arithmetic under sharding (equal to the unsharded run) is proven with two ranks in
test_z3_families.py, test_sharded_densemixer.py and test_slice_decay.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_lab.runtime.markers import marker_path
from tests.conftest import ROOT
from tests.presets import compose_preset, preset_rows, real_model_presets
from tests.test_presets_run import _reload

pytestmark = pytest.mark.slow


def combination(cfg) -> tuple | None:
    """What a sharded run of ``cfg`` can do differently (module docstring), or None off DeepSpeed."""
    strategy = cfg.hardware.trainer.get("strategy")
    if not (hasattr(strategy, "get") and str(strategy.get("_target_", "")).endswith("DeepSpeedStrategy")):
        return None
    method, optim = cfg.method, cfg.task.get("optim") or {}
    slice_decay = method.get("method") == "esft" and bool(optim.get("weight_decay"))  # ESFT decays slices itself
    return (cfg.task.name, method.get("method"), method.get("score"), bool(method.get("lora")), int(strategy.stage),
            bool(strategy.get("offload_optimizer")), slice_decay)


def sharded_rows() -> dict[tuple, tuple[str, tuple[str, ...]]]:
    """Each combination -> its first (preset, row), over every real-model preset's rows."""
    found: dict[tuple, tuple[str, tuple[str, ...]]] = {}
    for preset in real_model_presets():
        for row in preset_rows(preset):
            key = combination(compose_preset(preset, *row))
            if key is not None:
                found.setdefault(key, (preset, row))
    return found


def test_every_sharded_row_runs_on_its_tiny_sibling_under_its_strategy(tmp_path):
    rows = sharded_rows()
    assert {key[4] for key in rows} == {2, 3} and any(key[5] for key in rows)  # ZeRO-2, ZeRO-3 and its offload
    jobs = [(preset, list(row), str(tmp_path / str(i))) for i, (preset, row) in enumerate(rows.values())]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.runtime.sharded_rows_worker", str(tmp_path / "jobs.json"),
                           str(tmp_path / "results.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == len(jobs), proc.stderr[-4000:]
    failed = {f"{preset} {' '.join(row)}": r["error"] for (preset, row, _), r in zip(jobs, results) if "error" in r}
    assert not failed, "\n\n".join(f"{job}:\n{error}" for job, error in failed.items())
    for key, (preset, row, tmp), result in zip(rows, jobs, results):
        assert result["exports"], (preset, row)
        for path in result["exports"]:
            assert _reload(Path(path)) is not None, (preset, row, path)
        if key[0] == "finetune":  # the run trained under the preset's stage (moe-lab's checkpoint marker)
            ckpt = Path(tmp) / "run" / "checkpoints" / "last.ckpt"
            assert json.loads(marker_path(ckpt).read_text())["strategy"] == f"deepspeed_zero{key[4]}", (preset, row)
