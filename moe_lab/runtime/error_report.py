"""How a failed ``python run.py`` ends. moe-lab's own checks raise ``ValueError`` / ``FileNotFoundError`` with the
field and the fix in the message: a single run ends with that message, last and plain on stderr (exit code 1),
after one line naming where it was raised and where its traceback went (the run's ``run.log``). Any other error,
every error of a ``-m`` sweep (its jobs go on; the sweep summary holds each error) and every error under
``HYDRA_FULL_ERROR=1`` (Hydra's convention) keep Hydra's traceback."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from hydra.errors import InstantiationException

OWN_CHECKS = (ValueError, FileNotFoundError)
PACKAGE = Path(__file__).resolve().parents[1]


def own_check(error: BaseException, entry_point: Path) -> BaseException | None:
    """``error`` (or the error a Hydra ``instantiate`` wrapped) when it is one of OWN_CHECKS raised by moe-lab's
    code (the package or ``entry_point``); None for anything else."""
    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__
    if not isinstance(error, OWN_CHECKS) or error.__traceback__ is None:
        return None
    path = Path(_innermost(error).tb_frame.f_code.co_filename).resolve()
    return error if path.is_relative_to(PACKAGE) or path == entry_point.resolve() else None


def _innermost(error: BaseException):
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def _traceback_to_log_files(error: BaseException) -> list[str]:
    """The traceback written to the root logger's files (Hydra's ``run.log``) only; their paths."""
    record = logging.LogRecord("moe_lab.run", logging.ERROR, __file__, 0, "the run failed", None,
                               (type(error), error, error.__traceback__))
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for handler in files:
        handler.handle(record)
    return [h.baseFilename for h in files]


def end_with_message(error: BaseException, entry_point: Path, multirun: bool) -> None:
    """Exit with the message of an own check (see the module docstring); return for anything else."""
    own = own_check(error, entry_point)
    if own is None or multirun or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    tb = _innermost(own)
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path
    logs = _traceback_to_log_files(own)
    traceback_at = f"in {', '.join(logs)}; " if logs else ""
    print(f"{type(own).__name__} raised at {where}:{tb.tb_lineno} (traceback {traceback_at}HYDRA_FULL_ERROR=1 "
          f"prints it)\nError: {own}", file=sys.stderr, flush=True)
    sys.exit(1)
