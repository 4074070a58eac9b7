"""Results tables in the papers' shape: one row per (model, method), one column per dataset, then the average.

Accuracies are shown in percent; perplexity columns are shown as they are and are never averaged.
``python -m moe_lab.eval.results RUN_DIR [RUN_DIR ...] --out DIR`` merges the ``summary.json`` of several
``task=evaluate`` runs (e.g. a ``-m`` sweep over checkpoints: pass the sweep directory, or ``<sweep>/*``) into one
table.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

AVERAGE = "Avg."


@dataclass
class ResultsTable:
    """Cells keyed by ``(model, method)`` and column name; ``averaged`` columns enter the average."""

    columns: list[str] = field(default_factory=list)
    averaged: set[str] = field(default_factory=set)
    cells: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)

    def add(self, model: str, method: str, column: str, value: float | None, averaged: bool = True) -> None:
        """Set one cell (percent for accuracies); ``None`` leaves the cell empty."""
        if column not in self.columns:
            self.columns.append(column)
        if averaged:
            self.averaged.add(column)
        row = self.cells.setdefault((model, method), {})
        if value is not None:
            row[column] = float(value)

    def average(self, key: tuple[str, str]) -> tuple[float | None, int]:
        """(mean over the row's averaged columns that have a value, how many of them had one)."""
        values = [v for c, v in self.cells[key].items() if c in self.averaged]
        return (sum(values) / len(values) if values else None), len(values)

    @property
    def n_averaged(self) -> int:
        return sum(c in self.averaged for c in self.columns)

    def ordered(self) -> list[str]:
        """Value columns in display order: the averaged ones, ``Avg.`` (if any are averaged), then the others."""
        main = [c for c in self.columns if c in self.averaged]
        return [*main, *([AVERAGE] if main else []), *(c for c in self.columns if c not in self.averaged)]

    def header(self) -> list[str]:
        return ["model", "method", *self.ordered()]

    def records(self, digits: int | None = 2) -> list[list]:
        """Rows of values in ``header()`` order (rounded to ``digits``; ``None`` where there is no value)."""
        rnd = (lambda v: v) if digits is None else (lambda v: round(v, digits))
        out = []
        for key, row in self.cells.items():
            avg, _ = self.average(key)
            values = {**row, AVERAGE: avg}
            out.append([*key, *(None if values.get(c) is None else rnd(values[c]) for c in self.ordered())])
        return out

    def write_csv(self, path) -> None:
        """CSV with the header, one line per row; ``n_averaged`` says how many columns the average covers."""
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow([*self.header(), "n_averaged"])
            for key, record in zip(self.cells, self.records()):
                writer.writerow(["" if v is None else v for v in record] + [self.average(key)[1]])

    def to_markdown(self, digits: int = 1) -> str:
        """A markdown table; an average over fewer columns than the table has is marked with ``*``."""
        lines = ["| " + " | ".join(self.header()) + " |", "|" + "---|" * len(self.header())]
        partial = False
        for key, record in zip(self.cells, self.records(digits=None)):
            avg, n = self.average(key)
            mark = "*" if avg is not None and n < self.n_averaged else ""
            partial |= bool(mark)
            cells = [key[0], key[1]]
            for column, value in zip(self.ordered(), record[2:]):
                places = digits if column in self.averaged or column == AVERAGE else 2
                shown = "–" if value is None else f"{value:.{places}f}"
                cells.append(shown + mark if column == AVERAGE and value is not None else shown)
            lines.append("| " + " | ".join(cells) + " |")
        if partial:
            lines.append("")
            lines.append("\\* average over the datasets with a result only (others skipped or unavailable)")
        return "\n".join(lines) + "\n"

    def write_markdown(self, path) -> None:
        Path(path).write_text(self.to_markdown(), encoding="utf-8")

    def log_wandb(self, loggers=(), key: str = "eval/results") -> bool:
        """Log the table to every Lightning ``WandbLogger`` in ``loggers`` (or the active ``wandb.run``).

        Returns whether it was logged anywhere.
        """
        from lightning.pytorch.loggers import WandbLogger

        columns, data = self.header(), self.records()
        logged = False
        for logger in loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key=key, columns=columns, data=data)
                logged = True
        if not logged:
            import wandb

            if wandb.run is not None:
                wandb.run.log({key: wandb.Table(columns=columns, data=data)})
                logged = True
        return logged

    def to_json(self) -> list[dict]:
        """Cells as ``[{"model", "method", "column", "value", "averaged"}]`` (what summary.json stores)."""
        return [{"model": m, "method": k, "column": c, "value": v, "averaged": c in self.averaged}
                for (m, k), row in self.cells.items() for c, v in row.items()]

    @classmethod
    def from_json(cls, cells: list[dict], columns: list[str] | None = None) -> ResultsTable:
        table = cls(columns=list(columns or []))
        for cell in cells:
            table.add(cell["model"], cell["method"], cell["column"], cell["value"], cell["averaged"])
        return table

    def merge(self, other: ResultsTable) -> None:
        """Add ``other``'s columns and cells (its cells win where both have one)."""
        for column in other.columns:
            if column not in self.columns:
                self.columns.append(column)
        self.averaged |= other.averaged
        for key, row in other.cells.items():
            self.cells.setdefault(key, {}).update(row)


def _is_eval_run(path: Path) -> bool:
    summary = path / "summary.json"
    try:
        return summary.is_file() and "table" in json.loads(summary.read_text())
    except (OSError, ValueError):
        return False


def expand_runs(paths) -> list[Path]:
    """Run directories from the command line: a sweep directory (``multirun/...``, ``outputs/evaluate/x``)
    stands for the ``task=evaluate`` runs inside it, in Hydra job order; other entries a shell glob brings
    along (``multirun.yaml``, ``summary.md``, folders without a summary) are skipped with a note."""
    runs: list[Path] = []
    for arg in paths:
        path = Path(arg)
        if path.is_dir() and not (path / "summary.json").is_file():
            inner = sorted((p for p in path.iterdir() if p.is_dir() and _is_eval_run(p)), key=_job_key)
            if inner:
                runs.extend(inner)
                continue
        if path.is_dir() and (path / "summary.json").is_file() or not path.exists():
            runs.append(path)  # a run directory (or a typo: collect names it)
        else:
            print(f"note: {path} is not a run directory, skipped", file=sys.stderr)
    return runs


def _job_key(path: Path):
    head = path.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else float("inf"), path.name)


def collect(run_dirs) -> ResultsTable:
    """One table from the ``summary.json`` of ``task=evaluate`` run directories, in the order given."""
    table = ResultsTable()
    for run in run_dirs:
        path = Path(run) / "summary.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: is {run} a task=evaluate run directory?")
        summary = json.loads(path.read_text())
        if "table" not in summary:
            raise ValueError(f"{path} has no 'table': it was not written by task=evaluate")
        table.merge(ResultsTable.from_json(summary["table"], summary.get("columns")))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_lab.eval.results",
                                     description="Merge task=evaluate runs into one results table.")
    parser.add_argument("runs", nargs="+", help="run directories holding summary.json, or sweep directories")
    parser.add_argument("--out", default=None, help="write results.csv and results.md into this directory")
    args = parser.parse_args(argv)
    try:
        runs = expand_runs(args.runs)
        if not runs:
            raise FileNotFoundError(f"no task=evaluate run directories (with a summary.json) in {' '.join(args.runs)}")
        table = collect(runs)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table.write_csv(out / "results.csv")
        table.write_markdown(out / "results.md")
    print(table.to_markdown(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
