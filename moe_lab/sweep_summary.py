"""One table for a Hydra multirun: final loss, eval metric and step-cost ratio per job.

Registered as a Hydra callback (conf/hydra/default.yaml); at the end of ``python run.py -m ...`` it reads
every job's ``summary.json`` and writes ``summary.csv`` and ``summary.md`` in the sweep directory.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from hydra.experimental.callback import Callback

COLUMNS = ("job", "model", "method", "steps", "train_loss", "val_loss", "val_ppl", "step_time_s", "step_ratio")


def sweep_rows(sweep_dir: str | Path) -> list[dict]:
    """One row per job directory with a summary.json; ``step_ratio`` is relative to the model's sft job."""
    rows = []
    for summary_path in sorted(Path(sweep_dir).glob("*/summary.json"), key=_job_order):
        summary = json.loads(summary_path.read_text())
        job = summary_path.parent.name
        val = summary.get("val/loss")
        rows.append({
            "job": job, "model": summary.get("model", ""), "method": summary.get("method", job),
            "steps": summary.get("global_step"), "train_loss": summary.get("train/loss"), "val_loss": val,
            "val_ppl": math.exp(val) if val is not None else None,
            "step_time_s": summary.get("step_time_median_s"), "step_ratio": None,
        })
    for row in rows:
        ref = next((r for r in rows if r["model"] == row["model"] and r["method"] == "sft"), None)
        if ref and ref["step_time_s"] and row["step_time_s"]:
            row["step_ratio"] = row["step_time_s"] / ref["step_time_s"]
    return rows


def _job_order(path: Path):
    """Hydra job number first (``10_...`` after ``9_...``), then the name."""
    head = path.parent.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else float("inf"), path.parent.name)


def write_sweep_summary(sweep_dir: str | Path) -> Path | None:
    """Write summary.csv and summary.md for ``sweep_dir``; returns the markdown path (None: no jobs)."""
    sweep_dir = Path(sweep_dir)
    rows = sweep_rows(sweep_dir)
    if not rows:
        return None
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

    def fmt(value):
        return "" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(row[c]) for c in COLUMNS) + " |" for row in rows]
    md = sweep_dir / "summary.md"
    md.write_text("\n".join(lines) + "\n")
    return md


class SweepSummaryCallback(Callback):
    """Hydra callback: write the sweep table when a multirun ends and print it."""

    def on_multirun_end(self, config, **kwargs) -> None:
        md = write_sweep_summary(config.hydra.sweep.dir)
        if md is not None:
            print(md.read_text())
            print(f"Sweep summary: {md}")
