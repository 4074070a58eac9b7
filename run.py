"""moe-lab entry point: ``python run.py [task=...] [model=...] [method=...] [dataset=...] [-m ...]``."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    from pathlib import Path

    from moe_lab.tasks import run_task

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
