"""moe-lab entry point: ``python run.py [task=...] [model=...] [method=...] [dataset=...] [-m ...]``."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf


def _route_lightning_logs_through_hydra() -> None:
    """Lightning gives its loggers their own console handler; Hydra already logs to the console and to
    run.log, so drop Lightning's handler and let its records propagate (each line printed once)."""
    import logging

    import lightning  # noqa: F401 - its import installs the handlers removed here

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    from pathlib import Path

    from moe_lab.tasks import run_task

    _route_lightning_logs_through_hydra()

    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    try:
        summary = run_task(cfg)
    finally:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    print(f"Output directory: {out}")
    return summary.get(cfg.get("optimized_metric")) if cfg.get("optimized_metric") else None


if __name__ == "__main__":
    main()
