"""Kill -9 / signal matrix (issue 21): every long task, run uninterrupted; run again, interrupted at a point where it
has saved progress; resumed with its documented command; the resumed run's outputs and metrics equal the
uninterrupted run's.

Each run is ``python run.py <overrides>`` exactly, forked from one server process that imported the libraries once
(a fresh interpreter per run would cost ~10 s of imports each). The interruption is deterministic: the forked child
patches one function of the task so that it sends itself SIGKILL (or SIGTERM) right after the n-th call returns.

case              interrupted                                   resumed with                 compared
finetune, kd,     kill -9 after step 3 (checkpoint at step 2)   task.resume=<run dir>        metrics.csv, last.ckpt,
condenser (bias                                                                              export (bitwise);
per micro-batch,                                                                             condenser.json
2 per step)
finetune          kill -9 inside the validation of step 4       task.resume=<run dir>        as above
                  (the last; checkpoint due: resumes from 2)
finetune, val at  kill -9 inside the validation of step 4       task.resume=<run dir>        as above
step 4 of 6       (resumes from 2); after step 5 (resumes from
                  step 4's checkpoint, written after its
                  validation)
finetune, val     kill -9 after step 3 (checkpoint at step 2,   task.resume=<run dir>        rows (less the later
every 2 steps     written after its validation)                 task.trainer.limit_val_      validations), weights
                                                                batches=0
calibrate         kill -9 after the 2nd partial save            same command, same run dir   calibration.safetensors
compress grid     kill -9 after 3 of 6 points; SIGTERM after 2  same command, same run dir   points.csv, grid.md
condense          SIGTERM after 1 search step; kill -9 after 3  same command, same run dir   summary, steps, export
teacher_logits    kill -9 between the record's write and rename the same command again       the record (bitwise),
                                                                                             its temporary removed
evaluate          kill -9 after 3 of 4 prediction batches       same command, same run dir   predictions, results

Signals in training, the prune / expert-removal studies and the grid in process: test_signal_resume_logging.py,
compress/test_sweep_resume.py, analysis/test_removal_resume.py, compress/test_condense_resume.py.
"""

from __future__ import annotations

import csv
import functools
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import DATA_DIR, ROOT, word_text

pytestmark = pytest.mark.slow

#: what a run would import (wandb, deepspeed through accelerate, the model class), imported once by the server
PRELOAD = ("torch", "lightning", "transformers", "datasets", "hydra", "matplotlib", "matplotlib.pyplot", "pandas",
           "safetensors", "wandb", "accelerate", "deepspeed", "transformers.models.olmoe.modeling_olmoe",
           "moe_lab.tasks", "moe_lab.runs.training", "moe_lab.methods.distill", "moe_lab.compress.calibration",
           "moe_lab.runs.compress", "moe_lab.runs.condense", "moe_lab.runs.evaluate",
           "moe_lab.tasks.teacher_logits", "moe_lab.runs.calibrate")


# the forked child ------------------------------------------------------------------------------------------------
def _resolve(target: str):
    module, _, qualname = target.partition(":")
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _interrupt_after(target: str, calls: int, signum: int) -> None:
    """Patch ``module:qualname`` so that its ``calls``-th call, once it returned, sends this process ``signum``."""
    owner, name = _resolve(target)
    real, count = getattr(owner, name), [0]

    def patched(*args, **kwargs):
        result = real(*args, **kwargs)
        count[0] += 1
        if count[0] == calls:
            os.kill(os.getpid(), signum)
        return result

    setattr(owner, name, staticmethod(patched) if isinstance(owner.__dict__.get(name), staticmethod) else patched)


def _child(request: dict) -> None:
    """Run ``run.py`` with the request's overrides in this (forked) process; exit with its status."""
    import runpy

    code = 1
    try:
        os.chdir(request["cwd"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        if request.get("interrupt"):
            target, calls, signum = request["interrupt"]
            _interrupt_after(target, int(calls), int(signum))
        sys.argv = [str(ROOT / "run.py"), *request["argv"]]
        runpy.run_path(str(ROOT / "run.py"), run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported through the log and the status
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """Read one JSON request per line, fork a child running it, answer ``{"rc": ...}`` (-9: killed by SIGKILL)."""
    os.environ.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                      MOE_LAB_DATA_DIR=str(DATA_DIR))
    sys.path.insert(0, str(ROOT))
    answers = os.fdopen(os.dup(1), "w")  # the protocol; whatever the libraries print goes to stderr
    os.dup2(2, 1)
    for module in PRELOAD:
        importlib.import_module(module)
    import torch

    torch.set_num_threads(1)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        start = time.time()
        _, status, usage = os.wait4(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "wall_s": time.time() - start,
                          "cpu_s": usage.ru_utime + usage.ru_stime}), file=answers, flush=True)


class Runner:
    """The test side of :func:`serve`."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.runtime.test_signal_matrix import serve; serve()"],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}
        self.times: list[tuple[str, float, float]] = []

    def __call__(self, argv: list[str], log: Path, interrupt: tuple | None = None) -> tuple[int, str]:
        request = {"argv": [str(a) for a in argv], "cwd": str(log.parent), "log": str(log), "interrupt": interrupt}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        self.times.append((f"{log.parent.name}/{log.stem}", answer["wall_s"], answer["cpu_s"]))
        return answer["rc"], log.read_text()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


SIGKILL, SIGTERM = int(signal.SIGKILL), int(signal.SIGTERM)


# the matrix ------------------------------------------------------------------------------------------------------
def _tensors(path: Path) -> tuple[dict, dict]:
    """Every tensor of a safetensors file, and its header metadata."""
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}  # noqa: SIM118 - safe_open has no __iter__


def _same_tensors(a: Path, b: Path) -> None:
    (ta, ma), (tb, mb) = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and ma == mb, (a, b)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), (a, key)


def _rows(path: Path, drop=()) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k not in drop} for row in csv.DictReader(f)]


def _values(rows: list[dict]) -> list[dict]:
    """CSV cells as numbers where they are (exact: float() of the text); metrics.csv's ``epoch`` is written ``0`` by
    an uninterrupted run and ``0.0`` after a resume (issue 21 item 4, the logging's), the same number."""
    def value(text: str):
        try:
            return float(text)
        except ValueError:
            return text
    return [{k: value(v) for k, v in row.items()} for row in rows]


def _summary(run: Path, drop=()) -> dict:
    return {k: v for k, v in json.loads((run / "summary.json").read_text()).items() if k not in drop}


def _training(whole: Path, run: Path, resumed_from: int = 2) -> None:
    """metrics.csv row for row (the rows before the checkpoint carried over), the final checkpoint's weights,
    optimizer and LR-schedule state and the export bit for bit, the summary's final metrics."""
    assert _values(_rows(run / "metrics.csv")) == _values(_rows(whole / "metrics.csv"))
    _same_state(whole, run)
    keep = [k for k in ("global_step", "train/loss", "val/loss", "val/ppl") if k in _summary(whole)]
    assert {k: _summary(run).get(k) for k in keep} == {k: _summary(whole)[k] for k in keep}
    assert _summary(run)["resumed_from_step"] == resumed_from


def _same_state(whole: Path, run: Path) -> None:
    from tests.methods.test_method_resume import assert_bitwise_equal

    want = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=True)
    got = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    for key in ("global_step", "state_dict", "optimizer_states", "lr_schedulers"):
        assert_bitwise_equal(got[key], want[key], key)
    _same_tensors(whole / "export" / "model.safetensors", run / "export" / "model.safetensors")


def _condenser(whole: Path, run: Path) -> None:
    """As :func:`_training` (the biases and their update counts are buffers of the state_dict), and condenser.json."""
    _training(whole, run)
    assert json.loads((run / "condenser.json").read_text()) == json.loads((whole / "condenser.json").read_text())


def _validation_off(whole: Path, run: Path) -> None:
    """Resumed with validation off: the uninterrupted run's rows less its validations after the checkpoint, each
    row at its own step (the checkpoint was written after a validation), its weights bit for bit."""
    want = [r for r in _values(_rows(whole / "metrics.csv")) if r["val/loss"] == "" or r["step"] < CHECKPOINT_STEP]
    assert _values(_rows(run / "metrics.csv")) == want
    _same_state(whole, run)


def _calibration(whole: Path, run: Path) -> None:
    _same_tensors(whole / "calibration.safetensors", run / "calibration.safetensors")
    assert not (run / "calibration.partial.safetensors").exists()


def _grid(whole: Path, run: Path) -> None:
    assert _rows(run / "points.csv", drop=("seconds",)) == _rows(whole / "points.csv", drop=("seconds",))
    assert (run / "grid.md").read_text() == (whole / "grid.md").read_text()
    assert _summary(run)["best_per_pair"] == _summary(whole)["best_per_pair"]


def _condense(whole: Path, run: Path) -> None:
    per_run = ("expert_search_s", "layer_search_s", "wall_time_s", "search_steps_reused", "search_progress",
               "export", "layer_loss_files")
    assert _summary(run, per_run) == _summary(whole, per_run) and _summary(run)["search_steps_reused"] > 0
    assert _rows(run / "search_progress.csv") == _rows(whole / "search_progress.csv")
    assert (run / "layer_losses.csv").read_text() == (whole / "layer_losses.csv").read_text()
    _same_tensors(whole / "export" / "model.safetensors", run / "export" / "model.safetensors")


def _teacher_logits(whole: Path, run: Path) -> None:
    _same_tensors(whole / "teacher_logits.safetensors", run / "teacher_logits.safetensors")
    assert not list(run.rglob(".*.tmp"))  # the killed run's temporary, removed when the next run took the directory
    assert _summary(run, ("file", "override")) == _summary(whole, ("file", "override"))


def _evaluate(whole: Path, run: Path) -> None:
    for name in ("singleeq", "addsub"):
        assert (run / "predictions" / f"{name}.jsonl").read_text() == \
            (whole / "predictions" / f"{name}.jsonl").read_text()
    assert _rows(run / "results.csv") == _rows(whole / "results.csv")
    assert _summary(run)["metrics"] == _summary(whole)["metrics"]


CHECKPOINT_STEP = 2  # training cases: checkpoints every 2 steps; killed after step 3 (its work is lost)
TRAIN = ["debug=fast", "callbacks=none", "task.trainer.max_steps=4", "task.trainer.val_check_interval=4",
         f"task.checkpoint_every_n_steps={CHECKPOINT_STEP}", "dataset.num_examples=16", "dataset.batch_size=2"]
SEARCH = ["num_sequences=4", "seq_len=16", "batch_size=1", "sample=first"]
AFTER_STEP_3 = ("lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop.advance", 3)
AFTER_STEP_5 = (AFTER_STEP_3[0], 5)
IN_VALIDATION = ("moe_lab.methods.base:MoELightningModule.validation_step", 1)  # the first validation batch
#: validates at step 4 of 6 (the checkpoint of step 4 is written once that validation has ended)
VALIDATING = [*TRAIN, "task.trainer.max_steps=6"]
#: the public code's bias update after every micro-batch, 2 per optimizer step: killed after step 3 (micro-batch 6);
#: the update of micro-batch 4, which ends step 2, must be in step 2's checkpoint. condenser_bias=updating: with
#: budget=replace every update then moves every bias. Lightning's val_check_interval counts micro-batches: 8, so that
#: step 2's checkpoint is written in on_train_batch_end (after a validation, it came after the update already)
CONDENSER_MICRO_BATCH = [*TRAIN, "method=condenser", "method.options.selection_updates=2",
                         "method.options.update_every=micro_batch", "method.options.condenser_bias=updating",
                         "task.trainer.accumulate_grad_batches=2", "task.trainer.val_check_interval=8"]


@dataclass
class Case:
    """``argv(shared)``: the run's overrides; ``interrupt``: (function, calls) after which ``signum`` is sent;
    resumed with ``task.resume=<run dir>`` (``task_resume``: training) or the same command into the same directory;
    ``oracle``: the case whose uninterrupted run this one shares (default: its own)."""

    argv: object
    interrupt: tuple
    compare: object
    signum: int = SIGKILL
    task_resume: bool = False
    resume_line: str | None = None  # printed by a signalled run
    check_interrupted: object = None  # what the interrupted run left (run dir)
    resumed: str = ""  # the resumed run's line saying what it took from the interrupted one
    resume_overrides: tuple = ()  # given with task.resume
    oracle: str = ""


def _no_record(run: Path) -> None:
    assert not (run / "teacher_logits.safetensors").exists() and not (run / "summary.json").exists()
    assert len(list(run.glob(".teacher_logits.safetensors.*.tmp"))) == 1  # killed between write and rename


def _partial_calibration(run: Path) -> None:
    assert (run / "calibration.partial.safetensors").is_file() and not (run / "calibration.safetensors").exists()


def _points(n: int, name: str = "points.csv"):
    def check(run: Path) -> None:
        assert len(_rows(run / name)) == n and not (run / "summary.json").exists()
    return check


def _steps(n: int):
    def check(run: Path) -> None:
        assert len(_rows(run / "search_progress.csv")) == n and not (run / "export").exists()
    return check


def _predictions(run: Path) -> None:
    lines = [len((run / "predictions" / f"{s}.jsonl").read_text().splitlines()) for s in ("singleeq", "addsub")
             if (run / "predictions" / f"{s}.jsonl").is_file()]
    assert lines == [4, 2] and not (run / "summary.json").exists()


def _checkpoint(run: Path, step: int = CHECKPOINT_STEP) -> None:
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step


def _grid_argv(s) -> list[str]:
    return ["task=compress", "compress=paper_grid", "compress.grid.scores=[sf]", "compress.grid.groupings=[rr]",
            f"compress.calibration_file={s['calibration']}", f"compress.eval.path={s['text']}",
            "compress.eval.max_length=64", "compress.eval.stride=64"]


CASES = {
    "finetune": Case(lambda s: TRAIN, AFTER_STEP_3, _training, task_resume=True, check_interrupted=_checkpoint),
    "finetune_in_validation": Case(lambda s: TRAIN, IN_VALIDATION, _training, task_resume=True,
                                   check_interrupted=_checkpoint, oracle="finetune"),
    "validating_in_validation": Case(lambda s: VALIDATING, IN_VALIDATION, _training, task_resume=True,
                                     check_interrupted=_checkpoint),
    "validating_after_checkpoint": Case(lambda s: VALIDATING, AFTER_STEP_5, functools.partial(_training, resumed_from=4),
                                        task_resume=True, check_interrupted=functools.partial(_checkpoint, step=4),
                                        oracle="validating_in_validation"),
    "validation_off_after_resume": Case(lambda s: [*TRAIN, "task.trainer.max_steps=6",
                                                   "task.trainer.val_check_interval=2"],
                                        AFTER_STEP_3, _validation_off, task_resume=True, check_interrupted=_checkpoint,
                                        resume_overrides=("task.trainer.limit_val_batches=0",)),
    "condenser_micro_batch": Case(lambda s: CONDENSER_MICRO_BATCH, (AFTER_STEP_3[0], 6), _condenser, task_resume=True,
                                  check_interrupted=_checkpoint),
    "kd": Case(lambda s: [*TRAIN, "method=kd", "method.teacher=${model}"], AFTER_STEP_3, _training,
               task_resume=True, check_interrupted=_checkpoint),
    "calibrate": Case(lambda s: s["calibrate"], ("moe_lab.compress.calibration:Calibration.save", 2), _calibration,
                      check_interrupted=_partial_calibration, resumed="resuming calibration from"),
    "compress_grid": Case(_grid_argv, ("moe_lab.core.stamped_log:PointLog.append", 3), _grid,
                          check_interrupted=_points(3), resumed="moe-lab compress: 3 points already in"),
    "compress_grid_sigterm": Case(_grid_argv, ("moe_lab.core.stamped_log:PointLog.append", 2), _grid,
                                  signum=SIGTERM, resume_line="Resume with: the same command and hydra.run.dir=",
                                  check_interrupted=_points(2), resumed="moe-lab compress: 2 points already in",
                                  oracle="compress_grid"),
    "condense_sigterm": Case(lambda s: s["condense"], ("moe_lab.core.stamped_log:PointLog.append", 1), _condense,
                             signum=SIGTERM, resume_line="Resume with: the same command and hydra.run.dir=",
                             check_interrupted=_steps(1), resumed="condense: 1 finished search steps in"),
    "condense_kill": Case(lambda s: s["condense"], ("moe_lab.core.stamped_log:PointLog.append", 3), _condense,
                          check_interrupted=_steps(3), resumed="condense: 3 finished search steps in",
                          oracle="condense_sigterm"),
    "teacher_logits": Case(lambda s: ["task=teacher_logits", *TRAIN],
                           ("moe_lab.distill.teacher_logits:save_file", 1), _teacher_logits,
                           check_interrupted=_no_record),
    "evaluate": Case(lambda s: ["task=evaluate", "eval=math7", "eval.datasets=[singleeq,addsub]", "eval.limit=4",
                                "eval.batch_size=2", "eval.generation.max_new_tokens=8"],
                     ("moe_lab.core.stamped_log:RecordLog.append", 3), _evaluate, check_interrupted=_predictions,
                     resumed="addsub: 2 of 4 rows already predicted"),
}


@pytest.fixture(scope="module")
def runner():
    start = time.time()
    serve = Runner()
    yield serve
    serve.close()
    wall, cpu = sum(t[1] for t in serve.times), sum(t[2] for t in serve.times)
    print(f"\nsignal matrix: {len(serve.times)} runs, {wall:.1f} s wall / {cpu:.1f} s CPU; {time.time() - start:.1f} s "
          "in all (server start included)")


@pytest.fixture(scope="module")
def shared(tmp_path_factory, runner):
    """Search / calibration text, and one uninterrupted task=calibrate (the calibrate case's oracle, and the
    calibration file of the grid and condense cases)."""
    tmp = tmp_path_factory.mktemp("matrix")
    text = word_text(tmp / "c4.txt", 30)
    calibrate = ["task=calibrate", "dataset@compress.calibration.dataset=c4",
                 f"compress.calibration.dataset.path={text}", "compress.calibration.save_every=1",
                 *[f"compress.calibration.{d}" for d in SEARCH]]
    rc, log = runner([*calibrate, f"hydra.run.dir={tmp / 'calibrate'}"], tmp / "calibrate.log")
    assert rc == 0, log[-3000:]
    calibration = tmp / "calibrate" / "calibration.safetensors"
    condense = ["task=condense", f"condense.calibration_file={calibration}", f"condense.search.dataset.path={text}",
                "condense.routed_experts=2", "condense.num_layers=1", "condense.measure_speed=false",
                "condense.layer_loss_metrics=[js]", "condense.export=condensed",
                *[f"condense.search.{d}" for d in SEARCH]]
    return {"text": text, "calibrate": calibrate, "calibration": calibration, "condense": condense,
            "whole": {"calibrate": tmp / "calibrate"}, "tmp": tmp}


@pytest.mark.parametrize("name", list(CASES))
def test_interrupted_run_resumes_to_the_uninterrupted_result(name, runner, shared, tmp_path):
    case = CASES[name]
    argv = case.argv(shared)
    oracle = case.oracle or name
    whole = shared["whole"].get(oracle)
    if whole is None:
        whole = tmp_path / "whole"
        rc, log = runner([*argv, f"hydra.run.dir={whole}"], tmp_path / "whole.log")
        assert rc == 0, log[-3000:]
        shared["whole"][oracle] = whole

    run = tmp_path / "run"
    rc, log = runner([*argv, f"hydra.run.dir={run}"], tmp_path / "interrupted.log", (*case.interrupt, case.signum))
    if case.signum == SIGKILL:
        assert rc == -SIGKILL, log[-3000:]
    else:
        assert rc == 128 + case.signum, log[-3000:]
        assert case.resume_line in log, log[-3000:]
    case.check_interrupted(run)

    resume = [f"task.resume={run}", *case.resume_overrides] if case.task_resume else [*argv, f"hydra.run.dir={run}"]
    rc, log = runner(resume, tmp_path / "resumed.log")
    assert rc == 0, log[-3000:]
    assert case.resumed in log
    case.compare(whole, run)
