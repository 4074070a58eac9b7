"""The finished points of a long study, written as each finishes (the whole CSV replaced atomically: a kill never
leaves a torn row) and read back by a re-run, which skips them. ``<name>.meta.json`` holds the settings the points
were measured with; a re-run with other settings is refused rather than mixing two studies in one table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd

from ..core.atomic import atomic_write_json, atomic_write_text
from ..core.plain import flatten


class PointLog:
    def __init__(self, path, keys: tuple[str, ...], settings: dict):
        self.path, self.keys = Path(path), tuple(keys)
        self.meta = self.path.with_suffix(".meta.json")
        self.settings = json.loads(json.dumps(settings, default=str))  # plain JSON types, comparable with the file
        self.rows: list[dict] = []
        if self.path.is_file() and self.meta.is_file():
            before, now = flatten(json.loads(self.meta.read_text())), flatten(self.settings)
            changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
            if changed:
                detail = ", ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed)
                raise ValueError(f"{self.path} holds points measured with other settings ({detail}): run into a new "
                                 "output directory (hydra.run.dir=...) or delete that file to start over")
            self.rows = pd.read_csv(self.path, keep_default_na=False, na_values=[""]).to_dict("records")

    def done(self) -> dict[tuple, dict]:
        """Finished points by key."""
        return {self.key(row): row for row in self.rows}

    def key(self, row: dict) -> tuple:
        return tuple(str(row[k]) for k in self.keys)

    def append(self, row: dict) -> None:
        if not self.rows:
            atomic_write_json(self.meta, self.settings)
        self.rows.append(row)
        buffer = io.StringIO()
        pd.DataFrame(self.rows).to_csv(buffer, index=False)
        atomic_write_text(self.path, buffer.getvalue())
