"""Load LLM-Adapters-style instruction data (fields instruction, input, output, answer) and validate it.

The same layout serves TIGER-Lab/MathInstruct (instruction, output, source).
"""

from __future__ import annotations

from moe_lab.data.sources import read_rows, row_start_lines, source_label, where

__all__ = ["REQUIRED_FIELDS", "load_llm_adapters", "row_start_lines", "validate_instruction_rows"]

REQUIRED_FIELDS = ("instruction", "output")


def validate_instruction_rows(rows: list[dict], source: str) -> list[dict]:
    """Check string ``instruction``/``output``; default ``input`` to ``""``; keep ``answer`` as str if present."""
    out = []
    for i, row in enumerate(rows):
        for field in REQUIRED_FIELDS:
            value = row.get(field)
            if value is None:
                raise ValueError(f"{where(source, i)}: required field '{field}' is missing (or null)")
            if not isinstance(value, str):
                raise TypeError(f"{where(source, i)}: field '{field}' must be a string, got {value!r}")
        row = dict(row)
        row["input"] = row.get("input") or ""
        if row.get("answer") is not None:
            row["answer"] = str(row["answer"])
        out.append(row)
    return out


def load_llm_adapters(path_or_id: str, split: str = "train", name: str | None = None) -> list[dict]:
    """Rows of a local ``.json`` (array) / ``.jsonl`` file, a URL, or a hub dataset id (``split``/``name`` for hub).

    Every row needs string ``instruction`` and ``output``; ``input`` defaults to ``""``; ``answer`` is optional
    (kept as str). A row missing a required field raises ``ValueError`` (``TypeError`` if not a string)
    naming the field, the file and the line where the row starts. A missing file or an unreachable hub id
    raises ``FileNotFoundError``/``OSError`` naming it and the ``dataset.path=/local/file.json`` override.
    """
    rows = read_rows(path_or_id, split=split, name=name)
    return validate_instruction_rows(rows, source_label(path_or_id))
