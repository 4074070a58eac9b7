"""task=estimate: FLOPs, parameters and memory of every method for ``cfg.model`` without weights (meta device)."""

from __future__ import annotations

import resource
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .. import methods as _methods  # noqa: F401  (each method's module registers its row of the estimate)
from ..analysis.estimate import Options, architecture_config, estimate
from ..analysis.estimate_report import figure, write_tables
from ..analysis.report import log_images
from ..core.atomic import atomic_write_json
from ..models import DTYPES


def estimate_task(cfg: DictConfig) -> dict:
    """Write estimate.json / .md / .csv / .png into the run directory; returns a short summary."""
    start = time.time()
    out = Path(cfg.paths.output_dir)
    t = cfg.task
    known = set(Options.__dataclass_fields__)
    methods = OmegaConf.to_container(t.methods) or {}
    unknown = set(methods) - known
    if unknown:
        raise ValueError(f"task.methods.{min(unknown)} is not an estimate option: choose from {sorted(known)}")
    for key in ("seq_len", "batch", "gpus"):
        if int(t[key]) <= 0:
            raise ValueError(f"task.{key}={t[key]} must be a positive integer")
    config = architecture_config(cfg.model)
    result = estimate(config, seq_len=int(t.seq_len), batch=int(t.batch), opts=Options(**methods), gpus=int(t.gpus),
                      param_bytes=int(t.memory.param_bytes), grad_bytes=int(t.memory.grad_bytes),
                      optimizer_bytes=int(t.memory.optimizer_bytes), dtype=DTYPES[cfg.model.get("dtype") or "bfloat16"])
    result["model"] = cfg.model.name
    atomic_write_json(out / "estimate.json", result)
    title = f"{cfg.model.name} ({config.model_type})"
    write_tables(result, out, title)
    png = figure(result, out / "estimate.png", title)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary = {"params_total": result["params_total"], "params_active": result["params_active"],
               "densemixer_ratio_to_sft": result["methods"]["densemixer"]["ratio_to_sft"],
               "wall_time_s": round(time.time() - start, 2), "peak_rss_mib": round(peak_mib, 1)}
    atomic_write_json(out / "summary.json", summary, indent=2)
    log_images(cfg, {"estimate/costs": png}, summary)
    print(f"==== moe-lab estimate: {title}: total {result['params_total']:,}, active {result['params_active']:,}; "
          f"{summary['wall_time_s']} s, peak RSS {peak_mib:.0f} MiB -> {out / 'estimate.md'}", flush=True)
    return summary
