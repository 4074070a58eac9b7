"""One table for a Hydra multirun: final loss, eval metric and step-cost ratio per job.

Registered as a Hydra callback (conf/hydra/default.yaml); after every job of ``python run.py -m ...`` it reads
every job's ``summary.json`` (or ``failed.json``: the error of a job that raised) and rewrites ``summary.csv``
and ``summary.md`` in the sweep directory, so a failing job leaves its row and the table of the others.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

from hydra.experimental.callback import Callback

COLUMNS = ("job", "model", "method", "steps", "train_loss", "val_loss", "val_ppl", "step_time_s", "step_ratio",
           "error")
FAILED = "failed.json"


def sweep_rows(sweep_dir: str | Path) -> list[dict]:
    """One row per job directory with a summary.json; ``step_ratio`` is relative to the model's sft job."""
    rows = []
    paths = {p.parent: p for p in Path(sweep_dir).glob(f"*/{FAILED}")}
    paths.update({p.parent: p for p in Path(sweep_dir).glob("*/summary.json")})  # a re-run that succeeded wins
    for summary_path in sorted(paths.values(), key=_job_order):
        summary = json.loads(summary_path.read_text())
        job = summary_path.parent.name
        val = summary.get("val/loss")
        rows.append({
            "job": job, "model": summary.get("model", ""), "method": summary.get("method", job),
            "steps": summary.get("global_step"), "train_loss": summary.get("train/loss"), "val_loss": val,
            "val_ppl": math.exp(val) if val is not None else None,
            "step_time_s": summary.get("step_time_median_s"), "step_ratio": None, "error": summary.get("error"),
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
    # jobs on a cluster finish at the same time: each writes a file of its own, then renames it into place
    tmp = sweep_dir / f".summary.csv.{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

    def fmt(value):
        if isinstance(value, str):
            return value.replace("|", "/").replace("\n", " ")
        return "" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(row[c]) for c in COLUMNS) + " |" for row in rows]
    md = sweep_dir / "summary.md"
    os.replace(tmp, sweep_dir / "summary.csv")
    tmp = sweep_dir / f".summary.md.{os.getpid()}"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, md)
    return md


def record_failure(job_dir: str | Path, config, error: BaseException) -> Path:
    """``<job dir>/failed.json``: the failed job's model, method and error, for its row of the sweep table."""
    from omegaconf import OmegaConf

    from .core.atomic import atomic_write_json

    chain = error_chain(error)
    return atomic_write_json(Path(job_dir) / FAILED, {
        "model": OmegaConf.select(config, "model.name", default=""),
        "method": OmegaConf.select(config, "method.name", default=""),
        "error": chain[-1] if len(chain) == 1 else f"{chain[-1]} (raised as {chain[0]})",
        "error_chain": chain,
    })


def error_chain(error: BaseException) -> list[str]:
    """``"Type: first line"`` of ``error`` and of each exception it was raised from or during, outermost first:
    Hydra's ``InstantiationException: Error in call to target ...`` hides the root cause in its chain."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error).strip()
        chain.append(f"{type(error).__name__}: {text.splitlines()[0] if text else ''}")
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return chain


def log_sweep_table(config, sweep_dir: str | Path) -> Path | None:
    """With ``logger=wandb``: the sweep table as a ``wandb.Table`` in a W&B run of the sweep's group (a failure is
    a warning: the CSV and Markdown tables are written already)."""
    import logging

    from moe_lab.runtime.resume import wandb_logger_nodes

    names = wandb_logger_nodes(config)
    rows = sweep_rows(sweep_dir)
    if not names or not rows:
        return None
    try:
        from moe_lab.callbacks.wandb_media import log_sweep_table as log_table

        return log_table(sweep_dir, rows, COLUMNS, config.logger[names[0]])
    except Exception as error:  # noqa: BLE001
        logging.getLogger(__name__).warning("sweep summary not logged to W&B (%s: %s)", type(error).__name__, error)
        return None


class SweepSummaryCallback(Callback):
    """Hydra callback: rewrite the sweep table after every job (failed ones included) and print it at the end."""

    def on_job_start(self, config, **kwargs) -> None:
        """In a multirun, ``WANDB_RUN_GROUP`` = the sweep directory's name: conf/logger/wandb.yaml's W&B group."""
        from moe_lab.callbacks.wandb_media import sweep_group

        group = sweep_group(None)
        if group is not None:
            os.environ["WANDB_RUN_GROUP"] = group

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            return
        if job_return.status.name == "FAILED":
            record_failure(hydra_cfg.runtime.output_dir, config, job_return._return_value)
        write_sweep_summary(hydra_cfg.sweep.dir)

    def on_multirun_end(self, config, **kwargs) -> None:
        md = write_sweep_summary(config.hydra.sweep.dir)
        if md is not None:
            print(md.read_text())
            print(f"Sweep summary: {md}")
            log_sweep_table(config, config.hydra.sweep.dir)
