"""Checkpoints: atomic writes (a crash mid-save never leaves a truncated last.ckpt), one on SIGINT/SIGTERM/
SIGUSR1, and reading a checkpoint back with errors that say what it is."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..core.atomic import explain_write_failure, umask_mode
from ..core.method_class import module_fact
from .after_validation import AfterValidation
from .marker_recovery import ADOPT_FIELD, adopt_pending, drop_pending, reverify, write_pending
from .markers import MARKER, complete_beside, marker_path, sha256_file

CONVERT = "python -m moe_lab.runtime.checkpoint_io convert"

log = logging.getLogger(__name__)


class _HashingWriter:
    """A write-only file object that feeds every byte written through sha256 (torch.save writes sequentially)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves to a temporary file in the target directory, fsyncs, then renames over the target. The file's sha256
    is computed while it is written (no second read) and kept in ``digests`` for its COMPLETED marker. With the
    marker's other fields given in ``marker_info`` (by the caller that marks it), the marker is written first, as a
    pending marker named by that hash (:mod:`.marker_recovery`): a kill between the two renames loses nothing."""

    def __init__(self):
        super().__init__()
        self.digests: dict[str, str] = {}
        self.marker_info: dict[str, dict] = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, umask_mode())
            with explain_write_failure(path), os.fdopen(fd, "wb") as f:
                writer = _HashingWriter(f)
                torch.save(checkpoint, writer)
                f.flush()
                os.fsync(f.fileno())
            info = self.marker_info.pop(os.path.abspath(path), None)
            if info is not None:
                write_pending(path, info, writer.sha.hexdigest())
            os.replace(tmp, path)
            self.digests[os.path.abspath(path)] = writer.sha.hexdigest()
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def read_checkpoint(path: str | Path, field: str = "task.ckpt_path") -> dict:
    """A task=finetune checkpoint, memory-mapped (cheap to open); a ``ValueError`` naming ``field`` when the
    file is not one (unreadable, or not a Lightning checkpoint with a state dict and moe-lab hyperparameters)."""
    path = Path(path)
    if path.is_dir() and (path / "latest").is_file():
        return _read_zero_checkpoint(path)
    if not path.is_file():
        raise FileNotFoundError(f"{field}={path}: no such file (resume with task.resume=<run dir>, or point "
                                f"{field} at <run dir>/checkpoints/last.ckpt)")
    try:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (non-zip) torch file cannot be memory-mapped
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file: the cause goes in the message
        raise ValueError(f"{field}={path}: torch cannot read it ({type(err).__name__}): the file is truncated or "
                         f"corrupted, or is not a checkpoint. {complete_beside(path)}") from None
    hparams = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    if not isinstance(hparams, dict) or "method" not in hparams or "state_dict" not in ckpt:
        raise ValueError(f"{field}={path} is not a moe-lab checkpoint (no Lightning state_dict with moe-lab "
                         "hyperparameters). Use <run dir>/checkpoints/last.ckpt of a task=finetune run.")
    return ckpt


def _read_zero_checkpoint(path: Path) -> dict:
    """A DeepSpeed checkpoint directory's Lightning state (rank zero's model-states file) with ``state_dict`` =
    every parameter and buffer as a meta tensor of its full shape (ZeRO-3 stores partitions), for
    :func:`check_matches`."""
    tag = (path / "latest").read_text().strip()
    files = [path / tag / name for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")]
    state = torch.load(next((f for f in files if f.is_file()), files[0]), map_location="cpu", weights_only=False)
    shapes = {}
    for group in state.get("param_shapes") or []:
        shapes.update(group)
    shapes.update(state.get("frozen_param_shapes") or {})
    module = state.get("module") or {}
    shapes.update({name: module[name].shape for name in state.get("buffer_names") or [] if name in module})
    state["state_dict"] = {k.removeprefix("_forward_module."): torch.empty(v, device="meta")
                           for k, v in shapes.items()}
    return state


def checkpoint_label(ckpt: dict, path: Path) -> str:
    """``"<model> / <method>"`` of the run that wrote ``ckpt`` (stored in it, else its run's config.yaml)."""
    info = ckpt.get("moe_lab") or {}
    model = info.get("model")
    if model is None:
        config = Path(path).parent.parent / "config.yaml"
        if config.is_file():
            from omegaconf import OmegaConf

            model = OmegaConf.select(OmegaConf.load(config), "model.name")
    return f"{model or 'another model'} / {ckpt['hyper_parameters'].get('name') or ckpt['hyper_parameters']['method']}"


def check_matches(ckpt: dict, path: Path, module: torch.nn.Module, config_label: str,
                  field: str = "task.ckpt_path") -> None:
    """Refuse a checkpoint whose weights do not fit ``module`` (another model or method), naming both."""
    theirs = {k: tuple(v.shape) for k, v in ckpt["state_dict"].items()}
    ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    if theirs != ours:
        missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        shapes = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
        detail = "; ".join(f"{what}: {keys[0]}" + (f" (+{len(keys) - 1} more)" if len(keys) > 1 else "")
                           for what, keys in (("missing", missing), ("unexpected", extra),
                                              ("other shape", shapes)) if keys)
        raise ValueError(f"{field}={path}: the checkpoint is {checkpoint_label(ckpt, path)}, the config is "
                         f"{config_label} ({detail}). Resume with the run's own config: "
                         "task.resume=<run dir> (it re-applies that run's overrides).")


class CheckpointOnSignal(AfterValidation):
    """SIGINT (Ctrl-C), SIGTERM and SIGUSR1 (a scheduler's warning) stop training after the current optimizer
    step, with ``ckpt_path`` written; a second Ctrl-C aborts at once. ``signum`` is the signal received (None:
    none).

    The checkpoint is written at the end of the first optimizer step after the signal, where ``ModelCheckpoint``
    writes its own: in ``on_train_batch_end``, or, when Lightning validates at that step, once the validation has
    ended and is logged (:mod:`moe_lab.runtime.after_validation`). A resumed run then equals an uninterrupted one
    (weights, and the rows it logs). The fit stops (``SIGTERMException``) when the next batch starts. Stopping
    anywhere else loses something: before a validation due at the step, its row (the resumed run skips it); in
    the middle of gradient accumulation, the accumulated gradients. Under DDP the ranks decide together at every
    optimizer step (one all-reduce of the signal number), so a signal delivered to any rank stops them all at the
    same step.
    """

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")

    def __init__(self, ckpt_path: str | Path):
        self.ckpt_path = Path(ckpt_path)
        self.signum: int | None = None
        self.saved: Path | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: stop now, without a checkpoint
            return
        self.signum = signum
        print(f"\n{signal.Signals(signum).name} received: finishing this optimizer step, then writing "
              f"{self.ckpt_path} (press Ctrl-C again to abort without it)", file=sys.stderr, flush=True)

    def _agreed_signal(self, trainer) -> int | None:
        """The signal any rank received (the largest number), on every rank; one collective per call."""
        if trainer.world_size == 1:
            return self.signum
        mine = torch.tensor(float(self.signum or 0), device=trainer.strategy.root_device)
        agreed = int(trainer.strategy.reduce(mine, reduce_op="max"))
        return agreed or None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.saved is not None or trainer.fit_loop._should_accumulate():
            return  # only where an optimizer step just ended (as moe_lab.runtime.strategies.optimizer_stepped)
        signum = self._agreed_signal(trainer)
        if signum is not None:
            self.signum = self.signum or signum
            self.at_step_end(trainer, lambda: self._save(trainer))

    def _save(self, trainer) -> None:
        _save_marked(trainer, self.ckpt_path)
        self.saved = self.ckpt_path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.saved is not None:
            raise SIGTERMException  # what Lightning raises on SIGTERM; task=finetune exits 128 + signum


# ---- COMPLETED markers, keep-last-N, cross-strategy resume, ZeRO -> HF conversion ----------------------------



def _marker_info(trainer) -> dict:
    """A COMPLETED marker's fields but the hash: step, strategy, world size."""
    from .strategies import strategy_kind

    return {"global_step": int(trainer.global_step), "strategy": strategy_kind(trainer.strategy),
            "world_size": int(trainer.world_size)}


def mark_completed(trainer, ckpt: str | Path) -> None:
    """Rank zero writes the marker (JSON: step, strategy, world size, sha256) once every rank finished saving
    ``ckpt`` (``Trainer.save_checkpoint`` ends with a barrier); the pending marker written before the file's
    rename is dropped."""
    import json

    if not trainer.is_global_zero:
        return
    info = {**_marker_info(trainer), "sha256": content_digests(Path(ckpt), trainer)}
    target = marker_path(ckpt)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(info) + "\n")  # open(): the umask's mode
    os.replace(tmp, target)
    drop_pending(Path(ckpt))


def content_digests(ckpt: Path, trainer=None) -> dict[str, str]:
    """``{name: sha256}`` of a checkpoint file (the digest :class:`AtomicCheckpointIO` computed while writing it,
    else read back) or of every file inside a DeepSpeed checkpoint directory (names relative to it)."""
    if ckpt.is_dir():
        return {str(p.relative_to(ckpt)): sha256_file(p) for p in sorted(ckpt.rglob("*"))
                if p.is_file() and p.name != MARKER}
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    known = getattr(io, "digests", {}).pop(os.path.abspath(ckpt), None)
    return {ckpt.name: known or sha256_file(ckpt)}


def verify_digests(path: Path, info: dict, field: str) -> None:
    """Refuse ``path`` when its content differs from the sha256 its COMPLETED marker ``info`` recorded."""
    recorded = info["sha256"]
    actual = content_digests(path)
    bad = sorted(name for name in set(recorded) | set(actual) if recorded.get(name) != actual.get(name))
    if bad:
        where = path if not path.is_dir() else path / bad[0]
        raise ValueError(f"{field}={path}: {where} does not match the sha256 recorded in its {MARKER} marker "
                         f"when it was written (corrupted or changed since; torch would load it without noticing). "
                         f"{complete_beside(path)}")


def _unmark(trainer, ckpt: str | Path) -> None:
    if trainer.is_global_zero:
        marker_path(ckpt).unlink(missing_ok=True)
        drop_pending(Path(ckpt))


def check_finite_weights(trainer, ckpt: Path) -> None:
    """Refuse to write ``ckpt`` from non-finite weights (each rank checks its own parameters or shards; the ranks
    agree through one all-reduce), so the checkpoints already written stay the last good ones."""
    module = trainer.lightning_module
    bad = next((name for name, p in module.named_parameters()
                if p.is_floating_point() and p.numel() and not bool(torch.isfinite(p).all())), None)
    if trainer.world_size > 1:
        flag = torch.tensor(float(bad is not None), device=trainer.strategy.root_device)
        if not int(trainer.strategy.reduce(flag, reduce_op="max")):
            return
    elif bad is None:
        return
    last = getattr(module, "last_finite_loss", None)
    raise FloatingPointError(
        f"the weights after optimizer step {trainer.global_step} are not finite ({bad or 'on another rank'}): "
        f"{ckpt} not written, the checkpoints written before are kept (resume one with task.resume=<run dir>/"
        f"checkpoints/<file>); last finite loss {'none' if last is None else f'{last:.6g}'}. Lower task.optim.lr")


def _save_marked(trainer, ckpt: Path, save=None) -> None:
    """``trainer.save_checkpoint`` then the COMPLETED marker (a directory loses its marker before it is rewritten;
    a file is replaced atomically, so until then the old one stays complete). Non-finite weights are never
    written (:func:`check_finite_weights`)."""
    check_finite_weights(trainer, Path(ckpt))
    if Path(ckpt).is_dir():
        _unmark(trainer, ckpt)
    trainer.strategy.barrier("moe_lab.unmark")
    io = getattr(trainer.strategy, "checkpoint_io", None)
    info = _marker_info(trainer)
    if trainer.is_global_zero and isinstance(getattr(io, "marker_info", None), dict) \
            and not info["strategy"].startswith("deepspeed"):  # a file: its pending marker, before the rename
        io.marker_info[os.path.abspath(ckpt)] = info
    if save is None:
        trainer.save_checkpoint(ckpt, weights_only=False)  # explicit: Lightning logs a line when it is left unset
    else:
        save()
    mark_completed(trainer, ckpt)


class CompletedCheckpoint(AfterValidation, ModelCheckpoint):
    """``ModelCheckpoint`` that marks each checkpoint COMPLETED once written (a directory checkpoint loses its
    marker before it is overwritten; files are replaced atomically), removes the marker with the checkpoint and,
    with ``keep_last`` > 0, keeps only the ``keep_last`` newest ``step-<n>.ckpt``. The checkpoint of a step that
    Lightning validates after is written once that validation has ended (:mod:`moe_lab.runtime.after_validation`).
    """

    def __init__(self, *args, keep_last: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_last = keep_last

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.at_step_end(trainer, lambda: super(CompletedCheckpoint, self).on_train_batch_end(
            trainer, pl_module, outputs, batch, batch_idx))

    def _save_checkpoint(self, trainer, filepath) -> None:
        _save_marked(trainer, Path(filepath), save=lambda: super(CompletedCheckpoint, self)._save_checkpoint(
            trainer, filepath))
        if self.keep_last and self.dirpath is not None:
            steps = sorted(Path(self.dirpath).glob("step-*.ckpt"), key=lambda p: int(p.stem.split("-")[1]))
            for old in steps[:-self.keep_last]:
                self.best_k_models.pop(str(old), None)
                self._remove_checkpoint(trainer, str(old))

    def _remove_checkpoint(self, trainer, filepath) -> None:
        _unmark(trainer, filepath)
        super()._remove_checkpoint(trainer, filepath)


def checkpoint_callback(dirpath: str | Path, every_n_train_steps: int, keep_last: int = 0) -> CompletedCheckpoint:
    """``last.ckpt`` every ``every_n_train_steps``; with ``keep_last`` (``task.keep_last_checkpoints``) > 0 also the
    ``keep_last`` newest ``step-<n>.ckpt`` (older ones deleted)."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise ValueError(f"task.keep_last_checkpoints={keep_last!r}: give an integer >= 0 (0 = only last.ckpt)")
    # enable_version_counter=False: a resumed run overwrites last.ckpt (atomically) even when its state does not
    # know the file (a signal checkpoint written before any periodic one), instead of starting last-v1.ckpt
    return CompletedCheckpoint(dirpath=dirpath, save_last=True, save_top_k=-1 if keep_last else 0,
                               filename="step-{step}", auto_insert_metric_name=False,
                               every_n_train_steps=every_n_train_steps, keep_last=keep_last,
                               enable_version_counter=False)


def _family(kind: str) -> str:
    return "deepspeed" if kind.startswith("deepspeed") else "fsdp" if kind == "fsdp" else "plain"


def _vouched(path: Path, field: str, strategy: str, adopt: bool) -> dict:
    """The marker info of ``path`` once its content is vouched for: by its marker's sha256, by a pending marker
    (:func:`.marker_recovery.adopt_pending`), or with ``adopt`` by re-verification; else a refusal naming why."""
    import json

    marker = marker_path(path)
    info = json.loads(marker.read_text()) if marker.is_file() else None
    if info is not None and info.get("sha256"):
        try:
            verify_digests(path, info, field)
            return info
        except ValueError:
            adopted = adopt_pending(path, field)  # a newer file published, its marker not yet
            if adopted is None:
                raise
            return adopted
    adopted = adopt_pending(path, field)
    if adopted is not None:
        return adopted
    if adopt:
        return reverify(path, field, strategy)
    how = (f"If you know it is complete, pass {ADOPT_FIELD}=true: the file is re-verified (every record's CRC-32, "
           "read back whole) and given a marker with its hash")
    if info is None:
        raise ValueError(
            f"{field}={path}: no {MARKER} marker ({marker}): the run stopped while saving it (half-written), or the "
            f"marker was deleted. {complete_beside(path)} {how}.")
    raise ValueError(
        f"{field}={path}: its {MARKER} marker ({marker}) records no sha256 (an older moe-lab's, or edited), so it "
        f"cannot vouch for the file: a corrupted checkpoint would train on. {how}. {complete_beside(path)}")


def check_resumable(path: str | Path, field: str, strategy: str, adopt: bool = False) -> None:
    """Refuse to resume ``path`` when it was written under a strategy whose checkpoint ``strategy``
    (:func:`moe_lab.runtime.strategies.config_strategy_kind`) cannot load, or when nothing vouches for its content
    (no COMPLETED marker, a marker without a hash, a hash that differs: :func:`_vouched`; ``adopt``:
    ``task.adopt_checkpoint``)."""
    import json

    path = Path(path)
    if not path.exists():
        return  # read_checkpoint names the missing file
    marker = marker_path(path)
    written = json.loads(marker.read_text()).get("strategy", "single") if marker.is_file() else strategy
    _check_strategy(path, field, strategy, written)
    _vouched(path, field, strategy, adopt)


def _check_strategy(path: Path, field: str, strategy: str, written: str) -> None:
    """Refuse a checkpoint ``written`` under a strategy whose optimizer state ``strategy`` cannot load."""
    if _family(written) == _family(strategy):
        if written != strategy and written.startswith("deepspeed"):
            raise ValueError(f"{field}={path} was written under {written}, this run is {strategy}: resume with "
                             f"hardware={written} (ZeRO partitions optimizer state per stage)")
        return
    convert = (f" or convert its weights ({CONVERT} {path} <export dir>) and start a new run from them with "
               "model.pretrained=<export dir>") if written.startswith("deepspeed") else ""
    raise ValueError(f"{field}={path} was written under {written}; this run uses {strategy}, which cannot load its "
                     f"optimizer state. Resume with the hardware it was written with{convert}.")


def _run_config(ckpt_dir: Path, run_dir: Path | None):
    from omegaconf import OmegaConf

    for run in [run_dir] if run_dir is not None else [ckpt_dir.parent.parent, ckpt_dir.parent]:
        if (run / "config.yaml").is_file():
            return OmegaConf.load(run / "config.yaml")
    raise FileNotFoundError(f"{ckpt_dir}: no config.yaml in {run_dir or 'its run directory'}; pass --run-dir "
                            "<run dir>")


def convert_zero_checkpoint(ckpt_dir: str | Path, out: str | Path, run_dir: str | Path | None = None) -> Path:
    """A DeepSpeed ZeRO (stage 1-3) checkpoint directory -> an HF export in ``out`` that vanilla transformers loads.

    The fp32 weights are gathered from the partitions by DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``;
    the run's ``config.yaml`` rebuilds the model and method (the Lightning module's keys, ``_forward_module.``
    prefixes of old Lightning versions stripped; loaded for the run's method, so a dense student of method=kd
    loads), and the method's own export writes ``out`` in the model's load dtype (LoRA merged, method metadata
    beside it), as finetune's export. A method that takes ``export_only`` is built with it (method=kd: the student
    without its teacher or teacher record, which need not exist any more)."""
    import inspect

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from hydra.utils import get_class, instantiate

    from ..core.precision import export_in_load_dtype
    from ..models import load_model

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "latest").is_file():
        raise ValueError(f"{ckpt_dir} is not a DeepSpeed checkpoint directory (no 'latest' file); a single-file "
                         ".ckpt needs no conversion (task=evaluate task.checkpoint=<file> reads it)")
    cfg = _run_config(ckpt_dir, Path(run_dir) if run_dir else None)
    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir))
    state = {k.removeprefix("_forward_module."): v for k, v in state.items()}
    model, tokenizer = load_model(cfg.model, method=cfg.method.name,
                                  dense=module_fact(cfg.method, "trains_dense_models", False))
    export_only = "export_only" in inspect.signature(get_class(cfg.method._target_)).parameters
    module = instantiate(cfg.method, model=model, optim=cfg.task.optim, scheduler=cfg.task.scheduler,
                         _recursive_=False, **({"export_only": True} if export_only else {}))
    try:
        module.load_state_dict(state)  # parameters and persistent buffers (condenser biases) alike
    except RuntimeError as err:
        raise ValueError(f"{ckpt_dir}: the checkpoint does not fit {cfg.model.name} / {cfg.method.name} of its "
                         f"run's config.yaml: {str(err).splitlines()[0]}") from None
    export_in_load_dtype(module.patch)  # the fp32 ZeRO weights were cast into the load dtype by load_state_dict
    return module.patch.export(Path(out), tokenizer=tokenizer)


def main(argv: list[str] | None = None) -> None:
    """``python -m moe_lab.runtime.checkpoint_io convert <zero checkpoint dir> <export dir> [--run-dir DIR]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m moe_lab.runtime.checkpoint_io")
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="DeepSpeed ZeRO checkpoint directory -> vanilla HF export")
    convert.add_argument("checkpoint")
    convert.add_argument("out")
    convert.add_argument("--run-dir", default=None, help="run directory holding config.yaml (default: the "
                         "checkpoint's)")
    args = parser.parse_args(argv)
    path = convert_zero_checkpoint(args.checkpoint, args.out, args.run_dir)
    print(f"wrote {path} (AutoModelForCausalLM.from_pretrained({str(path)!r}))")


if __name__ == "__main__":
    main()
