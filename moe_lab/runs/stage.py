"""The config of one stage of a multi-stage task (moe_to_dense, cd_moe_sft): the run's config, writing to the
stage's own folder."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict


def stage_config(cfg: DictConfig, out: Path, **updates) -> DictConfig:
    """A copy of ``cfg`` writing to ``out`` with dotted-key updates. Interpolations stay unresolved, so whatever
    refers to ``${paths.output_dir}`` (the CSV and W&B loggers' ``save_dir``, checkpoints) follows ``out``."""
    sub = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    out.mkdir(parents=True, exist_ok=True)
    with open_dict(sub):
        for key, value in {"paths.output_dir": str(out), **updates}.items():
            OmegaConf.update(sub, key, value, merge=False)
    return sub
