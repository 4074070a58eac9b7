"""Long loops of points (a compression grid, a pruning study) stopped by SIGINT / SIGTERM / SIGUSR1 (a scheduler's
warning) as training is: the point in hand finishes and is written, then the task exits with 128 + the signal
number, printing how to continue. A second Ctrl-C aborts at once."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Self


class RunInterrupted(SystemExit):
    """Training stopped on a signal after writing a checkpoint; the exit status is 128 + the signal number."""


class Interrupted(RunInterrupted):
    """A loop stopped on a signal after writing its finished points; ``hint`` says how to continue it."""

    def __init__(self, code: int, hint: str):
        super().__init__(code)
        self.hint = hint


class StopOnSignal:
    """``with StopOnSignal("the grid") as stop:`` ... ``if stop(): break`` ... ``stop.exit(hint)``."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")

    def __init__(self, what: str):
        self.what, self.signum, self._previous = what, None, {}

    def __enter__(self) -> Self:
        from . import slurm

        self._requeue = slurm.SubmititRequeue()  # finds submitit's handler before ours replaces it
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                if hasattr(signal, name):
                    self._previous[name] = signal.signal(getattr(signal, name), self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for name, handler in self._previous.items():
            signal.signal(getattr(signal, name), handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: stop now
            return
        self.signum = signum
        print(f"\n{signal.Signals(signum).name} received: finishing the point in hand of {self.what}, then writing "
              "the finished points (press Ctrl-C again to abort at once)", file=sys.stderr, flush=True)

    def __call__(self) -> bool:
        return self.signum is not None

    def exit(self, hint: str) -> None:
        """After the finished points are written: hand a SLURM job to submitit's requeue, else exit 128 + signum."""
        signum = self.signum
        self._requeue(signum)
        raise Interrupted(128 + int(signum), hint)
