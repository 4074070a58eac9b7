"""Resumable logs of finished work, stamped with the settings it was made with: ``<name>.meta.json`` beside the log
holds them; a re-run that finds the log continues it, and one with other settings is refused (naming the file,
each changed setting as before -> after, and the fix) rather than mixing two studies in one file.

Two formats share the one stamp (:class:`StampedLog`):

- :class:`PointLog`: a CSV of finished points (a compression grid or study, the condense searches), the whole CSV
  replaced atomically on each append, so a kill never leaves a torn row;
- :class:`RecordLog`: a JSONL file of records with an ``id`` (task=evaluate's predictions), appended a batch at a
  time with fsync; a last line cut short by a kill is dropped when it is read back.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from .atomic import atomic_write_json, atomic_write_text
from .plain import flatten

log = logging.getLogger(__name__)

#: the fix a refusal names
FIX = "run into a new output directory (hydra.run.dir=...) or delete that file to start over"

#: ``explain(log path, changed keys, "key: before -> after, ...")`` -> the refusal's message
Explain = Callable[[Path, list[str], str], str]


class StampedLog:
    """A log at ``path`` with the settings its contents were made with in ``meta`` (``.meta.json``).

    ``settings`` are kept as plain JSON values (``default`` converts what JSON cannot hold; None: refuse it), so
    they compare equal with the file. ``explain`` words the refusal of other settings (default: :meth:`refusal`),
    for a user that can say what a difference means."""

    #: what the log holds, for the default refusal: "<path> <HOLDS> with other settings (...)"
    HOLDS = "was written"

    def __init__(self, path: Path, meta: Path, settings: dict, *, default: Callable | None = None,
                 explain: Explain | None = None):
        self.path, self.meta = Path(path), Path(meta)
        # plain JSON types, comparable with the file
        self.settings = json.loads(json.dumps(settings, default=default))
        self.explain = explain or self.refusal

    def stamped(self) -> bool:
        """Whether the log and its settings are both on disk (an earlier run to continue)."""
        return self.path.is_file() and self.meta.is_file()

    def check(self) -> bool:
        """Refuse (ValueError, worded by ``explain``) a log on disk stamped with other settings; whether there is
        a stamped log to continue."""
        if not self.stamped():
            return False
        before, now = flatten(json.loads(self.meta.read_text())), flatten(self.settings)
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if changed:
            detail = ", ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed)
            raise ValueError(self.explain(self.path, changed, detail))
        return True

    def stamp(self) -> None:
        """Write the settings beside the log (atomically)."""
        atomic_write_json(self.meta, self.settings)

    def refusal(self, path: Path, changed: list[str], detail: str) -> str:
        """The default refusal: the file, the changed settings and :data:`FIX`."""
        return f"{path} {self.HOLDS} with other settings ({detail}): {FIX}"


class PointLog(StampedLog):
    """The finished points of a long study in the CSV ``path``, keyed by the columns ``keys``; the settings in
    ``<stem>.meta.json``, written with the first point. ``rows`` holds the points of an earlier run with the same
    settings (a re-run skips them)."""

    HOLDS = "holds points measured"

    def __init__(self, path, keys: tuple[str, ...], settings: dict, *, explain: Explain | None = None):
        path = Path(path)
        super().__init__(path, path.with_suffix(".meta.json"), settings, default=str, explain=explain)
        self.keys = tuple(keys)
        self.rows: list[dict] = []
        if self.check():
            self.rows = pd.read_csv(self.path, keep_default_na=False, na_values=[""]).to_dict("records")

    def done(self) -> dict[tuple, dict]:
        """Finished points by key."""
        return {self.key(row): row for row in self.rows}

    def key(self, row: dict) -> tuple:
        """The key of ``row``: its ``keys`` columns as strings (as they read back from the CSV)."""
        return tuple(str(row[k]) for k in self.keys)

    def append(self, row: dict) -> None:
        """Add a finished point: the whole CSV is replaced atomically (the settings are written first, once)."""
        if not self.rows:
            self.stamp()
        self.rows.append(row)
        buffer = io.StringIO()
        pd.DataFrame(self.rows).to_csv(buffer, index=False)
        atomic_write_text(self.path, buffer.getvalue())


class RecordLog(StampedLog):
    """``<directory>/<name>.jsonl``: records with an ``id``, appended a batch at a time; the settings in
    ``<name>.meta.json``, written when the log is opened without an earlier one. A re-run continues from the ids
    already there."""

    def __init__(self, directory: Path, name: str, settings: dict, *, explain: Explain | None = None):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        super().__init__(directory / f"{name}.jsonl", directory / f"{name}.meta.json", settings, explain=explain)
        if not self.check():
            self.stamp()

    def load(self) -> dict[str, dict]:
        """Records by ``str(id)``; a last line cut short by a crash is dropped (and removed from the file)."""
        if not self.path.is_file():
            return {}
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        records: dict[str, dict] = {}
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):  # an unterminated last line: a write interrupted mid-way
                    with open(self.path, "r+b") as f:
                        f.truncate(len(raw) - len(line))
                    log.warning("%s: dropped an incomplete last line (interrupted write)", self.path)
                    return records
                raise ValueError(f"{self.path}: line {n} is not valid JSON; delete the file to start over") from None
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError(f"{self.path}: line {n} has no 'id'; delete the file to start over")
            records[str(record["id"])] = record
        if raw and not raw.endswith(b"\n"):  # complete record, newline lost: appends must start a new line
            with open(self.path, "ab") as f:
                f.write(b"\n")
        return records

    def append(self, records: list[dict]) -> None:
        """Add ``records``, one JSON line each, flushed and fsynced before returning."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
            f.flush()
            os.fsync(f.fileno())
