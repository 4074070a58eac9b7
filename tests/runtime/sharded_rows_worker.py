"""Runs (preset, row) jobs on their tiny siblings under the preset's own DeepSpeed hardware config, on DeepSpeed's
CPU engine, one after the other in this process (tests/runtime/test_sharded_rows.py starts it once):

    python -m tests.runtime.sharded_rows_worker jobs.json results.json

``jobs.json``: ``[[preset, [row overrides...], tmp_dir], ...]``; ``results.json``: per job the summary's export
paths, or the traceback of the failure.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(jobs_file: str, results_file: str) -> None:
    from hydra import compose, initialize_config_dir

    import run
    from tests.deepspeed_cpu import allow_deepspeed_on_cpu
    from tests.presets import CONF
    from tests.test_presets_run import _exports, preset_overrides

    allow_deepspeed_on_cpu()
    results = []
    for preset, row, tmp in json.loads(Path(jobs_file).read_text()):
        on_cpu = ("hardware.trainer.accelerator=cpu", "hardware.trainer.devices=1")  # the preset's strategy, one rank
        try:
            overrides = [f"experiment={preset}", *preset_overrides(preset, Path(tmp), tuple(row), on_cpu)]
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides)
            summary = run.execute(cfg)
            results.append({"exports": [str(p) for p in _exports(summary)]})
        except Exception:  # noqa: BLE001 - reported per job; the test names the failing (preset, row)
            results.append({"error": traceback.format_exc()[-4000:]})
        Path(results_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])
