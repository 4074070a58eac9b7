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

from moe_lab.core.task_table import NO_RESUME, TASK_RESUME, TASKS

log = logging.getLogger("moe_lab.run")

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


#: set by expand_argv (unless the command sets hydra.output_subdir): Hydra writes no .hydra/; execute writes it with
#: config.yaml once it holds the run lock (a refused second run writes nothing into the live run's directory), and
#: into a directory that holds a run already, once the task accepts the run (a resume)
_DEFERRED_SUBDIR: str | None = None
#: set by expand_argv when the run directory holds a run already: its files are rewritten once the task accepts it
_EXISTING_RUN = False
#: set by expand_argv for task.resume: the one line that says which file the resume reads (logged when it starts)
RESUME_NOTE: str | None = None
HYDRA_SUBDIR = ".hydra"


#: what every moe-lab run directory holds (a directory with none of them is not a run: task.resume refuses it)
RUN_MARKERS = (f"{HYDRA_SUBDIR}/overrides.yaml", "config.yaml")


def _run_dir_of(resume: str) -> Path:
    """The run directory of ``task.resume=<run dir | checkpoint file | DeepSpeed checkpoint directory>``."""
    path = Path(resume).expanduser()
    if not path.exists():
        raise ValueError(f"task.resume={resume}: no such run directory or checkpoint file (nothing was created)")
    run_dir = path.parent.parent if path.is_file() or (path / "latest").is_file() else path
    if not any((run_dir / marker).exists() for marker in RUN_MARKERS):
        what = "the checkpoint's run directory " if run_dir != path else ""
        raise ValueError(f"task.resume={resume}: {what}{run_dir} is not a moe-lab run directory (none of "
                         f"{', '.join(RUN_MARKERS)} in it); nothing was written into it. Give the directory a run "
                         "wrote (outputs/<task>/<model>_<method>/<time>), or continue a checkpoint file in a new run "
                         "with task.ckpt_path=<file> and that run's overrides")
    return run_dir


def _task_of(run_dir: Path) -> str | None:
    """The task of the run in ``run_dir`` (its config.yaml, else its overrides; None: unknown)."""
    if (run_dir / "config.yaml").is_file():
        name = OmegaConf.select(OmegaConf.load(run_dir / "config.yaml"), "task.name")
        if name:
            return str(name)
    saved = run_dir / HYDRA_SUBDIR / "overrides.yaml"
    if saved.is_file():
        return next((o.split("=", 1)[1] for o in OmegaConf.to_container(OmegaConf.load(saved)) if _key(o) == "task"),
                    "finetune")
    return None


# Maps a config declares empty (``{}``) for the command line to fill: ``task.checkpoints.base=<export>`` adds a key
# (Hydra's struct mode would refuse it without a ``+``). Each names the field that selects the config declaring
# it (value None: any); a map given while that config is not chosen is refused after composition. A task's maps
# are in its row of the task table.
def open_maps() -> dict[str, tuple[str, str | None]]:
    """``{map: (field, value)}``: every task's open maps (its row of the task table) and eval's."""
    return {**{m: ("task.name", name) for name, task in TASKS.items() for m in task.open_maps},
            "eval.lm_eval.tasks": ("eval.name", None)}


def _open_map(override: str) -> str | None:
    """The :func:`open_maps` entry a plain ``key=value`` override fills (None for any other override)."""
    if override.startswith(("+", "~", "-")) or "=" not in override:
        return None
    key = _key(override)
    return next((m for m in open_maps() if key == m or key.startswith(m + ".")), None)


def check_open_maps(cfg: DictConfig, argv: list[str]) -> None:
    """Refuse a filled open map whose declaring config is not composed (it would be added and never read)."""
    for arg in argv:
        name = _open_map(arg.removeprefix("++"))
        if name is None or not arg.startswith("++"):
            continue
        field, wanted = open_maps()[name]
        chosen = OmegaConf.select(cfg, field, default=None)
        if chosen is None or (wanted is not None and chosen != wanted):
            need = f"{field.split('.')[0]}={wanted}" if wanted else f"an {field.split('.')[0]} group"
            raise ValueError(f"{_key(arg)}: only {need} reads {name} ({field} is {chosen}); drop the override "
                             f"or add {need}")


def expand_argv(argv: list[str]) -> list[str]:
    """Command-line conveniences, applied before Hydra parses it:

    * ``task.resume=<run dir>`` re-applies that run's overrides (from ``<run dir>/.hydra/overrides.yaml``;
      overrides given now win) and runs in that directory (a path that does not exist, or a run directory copied
      without ``.hydra/``, or a run of a task that task.resume does not continue, is refused: ``ValueError``, naming
      how that kind resumes);
    * Hydra writes no ``.hydra/`` (:data:`_DEFERRED_SUBDIR`): :func:`execute` writes it with config.yaml once it
      holds the run lock, and into a directory that holds a run already (a resume, or ``hydra.run.dir=<run dir>``)
      only once the task accepts the run;
    * ``method.options.<name>=v`` may name any option (``++``): a misspelt one is refused before Hydra runs,
      naming the nearest option (:func:`moe_lab.runtime.override_keys.check_override_keys`), or where that check
      leaves the command to Hydra (a sweep over ``method=``), by the method itself with the list of valid options;
    * the open maps (``task.checkpoints.<label>=...``, ``eval.lm_eval.tasks={...}``) accept new keys (``++``).
    """
    global _DEFERRED_SUBDIR, _EXISTING_RUN, RESUME_NOTE
    args = [f"++{a}" if (a.startswith("method.options.") and "=" in a) or _open_map(a) else a for a in argv[1:]]
    resume = next((a.split("=", 1)[1] for a in args if a.startswith("task.resume=")), None)
    multirun = bool({"-m", "--multirun"} & set(args))
    given = {_key(a) for a in args if not a.startswith("-")}
    run_dir = None
    if resume and multirun:
        raise ValueError(f"task.resume={resume}: task.resume does not work under -m (a sweep job would continue the "
                         "checkpoint in a new sweep directory with the default config): resume each run without -m")
    if resume:
        run_dir = _run_dir_of(resume)
        kind = _task_of(run_dir)
        how = TASKS[kind].resume if kind in TASKS else NO_RESUME
        if kind is not None and how != TASK_RESUME:
            raise ValueError(f"task.resume={resume}: {run_dir} is a task={kind} run, which task.resume does not "
                             f"continue: {how}")
        saved = run_dir / HYDRA_SUBDIR / "overrides.yaml"
        if not saved.is_file() and (run_dir / "config.yaml").is_file():
            raise ValueError(f"task.resume={resume}: {saved} is missing (a run directory copied without its hidden "
                             f"{HYDRA_SUBDIR}/?), so the run's own overrides cannot be re-applied: copy {HYDRA_SUBDIR}/ "
                             "too, or give the run's overrides again with task.ckpt_path=<checkpoint> instead")
        dropped = given | {"task.resume", "task.ckpt_path"}
        carried = [o for o in (OmegaConf.to_container(OmegaConf.load(saved)) if saved.is_file() else [])
                   if _key(o) not in dropped]
        here = [] if "hydra.run.dir" in given else [f"hydra.run.dir={run_dir}"]
        RESUME_NOTE = resume_note(run_dir, carried, [a for a in args if _key(a) != "task.resume"])
        args = [*carried, *args, *here]
    else:
        RESUME_NOTE = None
    pinned = next((a.split("=", 1)[1] for a in reversed(args) if _key(a) == "hydra.run.dir"), None)
    if pinned and not multirun:
        run_dir = Path(pinned).expanduser()
    _DEFERRED_SUBDIR = None
    if "hydra.output_subdir" not in given:
        args.append("hydra.output_subdir=null")
        _DEFERRED_SUBDIR = HYDRA_SUBDIR
    _EXISTING_RUN = run_dir is not None and (run_dir / HYDRA_SUBDIR).is_dir()
    return [argv[0], *args]


def resume_note(run_dir: Path, carried: list[str], given: list[str]) -> str:
    """The line a resume starts with: the file its settings come from, and that the run's config files are records
    (a hand edit of them is not applied)."""
    saved = run_dir / HYDRA_SUBDIR / "overrides.yaml"
    now = f"; given now: {' '.join(given)}" if given else ""
    return (f"task.resume: the run's settings are conf/ with the overrides of {saved} ({len(carried)} re-applied"
            f"{now}); {run_dir / HYDRA_SUBDIR / 'config.yaml'} and {run_dir / 'config.yaml'} are records of the "
            "run, not read: an edit there is not applied, give the change as an override after task.resume")


def write_run_files(cfg: DictConfig, out: Path, subdir: str | None) -> None:
    """``<out>/config.yaml`` (resolved) and, when Hydra was told not to (``subdir``), ``<out>/<subdir>/`` as Hydra
    writes it (config.yaml, hydra.yaml, overrides.yaml); rank zero only."""
    from hydra.core.hydra_config import HydraConfig
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) != 0:
        return
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if subdir and HydraConfig.initialized():
        hydra_dir = out / subdir
        hydra_dir.mkdir(parents=True, exist_ok=True)
        hydra_cfg = HydraConfig.instance().cfg
        for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra_cfg),
                           ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
            (hydra_dir / name).write_text(OmegaConf.to_yaml(node))


def shorten_dataset(cfg: DictConfig, overrides: list[str] | None = None) -> None:
    """``debug_dataset`` (set by ``debug=fast``): each of its keys the chosen dataset has, and the command line
    does not set, is set on ``cfg.dataset``; one line names what was shortened."""
    from hydra.core.hydra_config import HydraConfig

    shorter = cfg.get("debug_dataset")
    if not shorter or cfg.get("dataset") is None:
        return
    if overrides is None:
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else sys.argv[1:]
    given = {_key(a) for a in overrides}
    changed = {k: v for k, v in shorter.items() if k in cfg.dataset and f"dataset.{k}" not in given}
    for key, value in changed.items():
        cfg.dataset[key] = value
    if changed:
        log.info("debug_dataset: %s", ", ".join(f"dataset.{k}={v}" for k, v in changed.items()))


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from moe_lab.runtime.error_report import end_with_message

    try:
        summary = execute(cfg)
    except Exception as error:
        end_with_message(error, Path(__file__), multirun=HydraConfig.get().mode == RunMode.MULTIRUN)
        raise
    return summary.get(cfg.get("optimized_metric")) if cfg.get("optimized_metric") else None


def execute(cfg: DictConfig) -> dict:
    """Run (or with ``plan=true`` only plan) the composed config; returns the task's summary. ``main`` is this
    behind Hydra's command line; tests call it in-process on a config composed with ``paths.output_dir`` set."""
    from moe_lab.runtime.run_lock import RunLock

    _quiet()
    if not sys.stdout.isatty():  # carriage-return bars of file writes are noise in logs and CI
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    _route_lightning_logs_through_hydra()

    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with RunLock(out):  # before anything is written: a second run into a live run's directory writes nothing
        return _execute(cfg, out)


def _execute(cfg: DictConfig, out: Path) -> dict:
    from moe_lab.runs.checks import preflight
    from moe_lab.runtime.resume import accept_run, defer_run_files
    from moe_lab.runtime.stop_signal import RunInterrupted
    from moe_lab.tasks import run_task

    if RESUME_NOTE:
        log.info(RESUME_NOTE)
    check_open_maps(cfg, sys.argv[1:])
    shorten_dataset(cfg)
    defer_run_files(lambda: write_run_files(cfg, out, _DEFERRED_SUBDIR))
    if not _EXISTING_RUN:
        accept_run()  # a new run directory: written now
    if cfg.get("plan"):
        from moe_lab.runs.plan import plan

        preflight(cfg, plan=True)
        return plan(cfg)
    preflight(cfg)
    try:
        summary = run_task(cfg)
        accept_run()  # a task that does not accept a run itself: its files once it has succeeded
    except RunInterrupted as stopped:
        from moe_lab.runtime.checkpoint_io import marker_path

        if getattr(stopped, "hint", None):  # a loop of points (compress grid, prune study): how it continues
            print(stopped.hint, flush=True)
        elif marker_path(out / "checkpoints" / "last.ckpt").is_file():
            print(f"Resume with: python {Path(sys.argv[0]).name} task.resume={out}", flush=True)
        else:
            print("No complete checkpoint was written: start the run again", flush=True)
        raise
    finally:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    print(f"Output directory: {out}")
    return summary


if __name__ == "__main__":
    _quiet()
    try:
        from moe_lab.runtime.override_keys import check_override_keys

        sys.argv = expand_argv(sys.argv)
        check_override_keys(sys.argv[1:], Path(__file__).parent / "conf")
    except ValueError as err:
        sys.exit(f"Error: {err}")
    main()
