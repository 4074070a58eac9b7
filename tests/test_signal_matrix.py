"""Kill -9 / signal matrix (issue 21): every long task, run uninterrupted; run again, interrupted at a point where it
has saved progress; resumed with its documented command; the resumed run's outputs and metrics equal the
uninterrupted run's.

Each run is ``python run.py <overrides>`` exactly, forked from one server process that imported the libraries once
(a fresh interpreter per run would cost ~10 s of imports each). The interruption is deterministic: the forked child
patches one function of the task so that it sends itself SIGKILL (or SIGTERM) right after the n-th call returns.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

PRELOAD = ("torch", "lightning", "transformers", "datasets", "hydra", "matplotlib", "pandas", "safetensors",
           "moe_lab.tasks", "moe_lab.tasks.finetune", "moe_lab.methods.distill", "moe_lab.compress.calibration",
           "moe_lab.tasks.compress", "moe_lab.tasks.condense", "moe_lab.tasks.evaluate",
           "moe_lab.tasks.teacher_logits", "moe_lab.tasks.calibrate")


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
    os.environ.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    sys.path.insert(0, str(ROOT))
    for module in PRELOAD:
        importlib.import_module(module)
    import torch

    torch.set_num_threads(1)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


class Runner:
    """The test side of :func:`serve`."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.test_signal_matrix import serve; serve()"],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def __call__(self, argv: list[str], log: Path, interrupt: tuple | None = None) -> tuple[int, str]:
        request = {"argv": [str(a) for a in argv], "cwd": str(log.parent), "log": str(log), "interrupt": interrupt}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        rc = json.loads(self.proc.stdout.readline())["rc"]
        return rc, log.read_text()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


SIGKILL, SIGTERM = int(signal.SIGKILL), int(signal.SIGTERM)
