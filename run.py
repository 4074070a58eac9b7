"""moe-lab entry point: ``python run.py [task=...] [model=...] [method=...] [dataset=...] [-m ...]``.

``python run.py <overrides> plan=true`` prints what the run would do (data, steps, schedule, phases, memory, eval
sets) without loading weights or training. ``python run.py task.resume=<run dir>`` continues that run in its directory with its own overrides (any
override given after it wins, e.g. ``task.trainer.max_steps=2000`` to train longer).
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

NOISE = {  # logger name -> message fragments dropped from the console and run.log
    "lightning.pytorch.utilities.rank_zero": ("litlogger",),
    "DeepSpeed": ("Setting accelerator to CPU",),
    # a signal is announced by moe-lab's own line (naming the real signal: Lightning calls them all SIGTERM)
    "lightning.pytorch.trainer.connectors.signal_connector": ("Received SIGTERM",),
}


class _DropMessages(logging.Filter):
    def __init__(self, fragments):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def _quiet() -> None:
    """Silence advertisements and deprecation chatter of the libraries underneath (not their warnings)."""
    for name, fragments in NOISE.items():
        logging.getLogger(name).addFilter(_DropMessages(fragments))
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def _route_lightning_logs_through_hydra() -> None:
    """Lightning gives its loggers their own console handler; Hydra already logs to the console and to
    run.log, so drop Lightning's handler and let its records propagate (each line printed once)."""
    import lightning  # noqa: F401 - its import installs the handlers removed here

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


def _run_config(checkpoint: str) -> DictConfig | None:
    path = Path(checkpoint).expanduser()
    for run in (path.parent, path.parent.parent):
        if (run / "config.yaml").is_file():
            return OmegaConf.load(run / "config.yaml")
    return None


def run_name(model: str, method: str, checkpoint: str | None = None) -> str:
    """``<model>_<method>`` for run directories; for a ``task.checkpoint``, the model and method of the run that
    wrote it (else the checkpoint's directory name), not the config's."""
    if checkpoint:
        run = _run_config(str(checkpoint))
        if run is not None and OmegaConf.select(run, "model.name") and OmegaConf.select(run, "method.name"):
            return f"{run.model.name}_{run.method.name}"
        path = Path(str(checkpoint))
        return path.parent.name if path.name in ("export", "last.ckpt") else path.stem
    return f"{model}_{method}"


if not OmegaConf.has_resolver("moe_lab.run_name"):
    OmegaConf.register_new_resolver("moe_lab.run_name", run_name)


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def expand_argv(argv: list[str]) -> list[str]:
    """Command-line conveniences, applied before Hydra parses it:

    * ``task.resume=<run dir>`` re-applies that run's overrides (from ``<run dir>/.hydra/overrides.yaml``;
      overrides given now win) and runs in that directory;
    * ``method.options.<name>=v`` may name any option (``++``), so that a misspelt one is refused by the
      method itself with the list of valid options, instead of by Hydra with a ``+`` hint that fails too.
    """
    args = [f"++{a}" if a.startswith("method.options.") and "=" in a else a for a in argv[1:]]
    resume = next((a.split("=", 1)[1] for a in args if a.startswith("task.resume=")), None)
    if resume and not {"-m", "--multirun"} & set(args):
        run_dir = Path(resume).expanduser()
        run_dir = run_dir.parent.parent if run_dir.is_file() else run_dir
        saved = run_dir / ".hydra" / "overrides.yaml"
        given = {_key(a) for a in args if not a.startswith("-")}
        dropped = given | {"task.resume", "task.ckpt_path"}
        carried = [o for o in (OmegaConf.to_container(OmegaConf.load(saved)) if saved.is_file() else [])
                   if _key(o) not in dropped]
        here = [] if "hydra.run.dir" in given else [f"hydra.run.dir={run_dir}"]
        args = [*carried, *args, *here]
    return [argv[0], *args]


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    summary = execute(cfg)
    return summary.get(cfg.get("optimized_metric")) if cfg.get("optimized_metric") else None


def execute(cfg: DictConfig) -> dict:
    """Run (or with ``plan=true`` only plan) the composed config; returns the task's summary. ``main`` is this
    behind Hydra's command line; tests call it in-process on a config composed with ``paths.output_dir`` set."""
    from moe_lab.tasks import run_task
    from moe_lab.tasks.finetune import RunInterrupted
    from moe_lab.tasks.preflight import preflight

    _quiet()
    if not sys.stdout.isatty():  # carriage-return bars of file writes are noise in logs and CI
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    _route_lightning_logs_through_hydra()

    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if cfg.get("plan"):
        from moe_lab.tasks.plan import plan

        preflight(cfg, plan=True)
        return plan(cfg)
    preflight(cfg)
    try:
        summary = run_task(cfg)
    except RunInterrupted:
        print(f"Resume with: python {Path(sys.argv[0]).name} task.resume={out}", flush=True)
        raise
    finally:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    print(f"Output directory: {out}")
    return summary


if __name__ == "__main__":
    _quiet()
    sys.argv = expand_argv(sys.argv)
    main()
