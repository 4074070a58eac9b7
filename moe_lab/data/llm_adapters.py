"""Load LLM-Adapters-style instruction data (fields instruction, input, output, answer) and validate it."""

from __future__ import annotations

import json
import os

from datasets import load_dataset

REQUIRED_FIELDS = ("instruction", "output")
_OVERRIDE_HINT = "Point to a local copy with the Hydra override `dataset.path=/local/file.json`."


def _is_local(path_or_id: str) -> bool:
    return (
        path_or_id.endswith((".json", ".jsonl"))
        or os.path.isabs(path_or_id)
        or path_or_id.startswith((".", "~"))
        or os.path.exists(path_or_id)
    )


def row_start_lines(path: str) -> list[int]:
    """1-based line where each row of a JSON array or JSON-lines file starts (blank lines are skipped)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = len(text) - len(text.lstrip())
    if not text.startswith("[", start):  # JSON lines
        return [i + 1 for i, line in enumerate(text.split("\n")) if line.strip()]
    decoder, pos, line, counted, lines = json.JSONDecoder(), start + 1, 1, 0, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return lines
        line += text.count("\n", counted, pos)
        counted = pos
        lines.append(line)
        _, pos = decoder.raw_decode(text, pos)


def _where(source: str, i: int) -> str:
    if os.path.isfile(source):
        return f"{source}: row {i} starting at line {row_start_lines(source)[i]}"
    return f"{source}: row {i}"


def _validate(rows: list[dict], source: str) -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        for field in REQUIRED_FIELDS:
            value = row.get(field)
            if value is None:
                raise ValueError(f"{_where(source, i)}: required field '{field}' is missing (or null)")
            if not isinstance(value, str):
                raise TypeError(f"{_where(source, i)}: field '{field}' must be a string, got {value!r}")
        row = dict(row)
        row["input"] = row.get("input") or ""
        if row.get("answer") is not None:
            row["answer"] = str(row["answer"])
        out.append(row)
    return out


def load_llm_adapters(path_or_id: str, split: str = "train") -> list[dict]:
    """Rows of a local ``.json`` (array) / ``.jsonl`` file, or of a hub dataset id (``split`` used for hub only).

    Every row needs string ``instruction`` and ``output``; ``input`` defaults to ``""``; ``answer`` is optional
    (kept as str). A row missing a required field raises ``ValueError`` (``TypeError`` if not a string)
    naming the field, the file and the line where the row starts. A missing file or an unreachable hub id
    raises ``FileNotFoundError``/``OSError`` naming it and the ``dataset.path=/local/file.json`` override.
    """
    if _is_local(path_or_id):
        path = os.path.expanduser(path_or_id)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Dataset file {path_or_id!r} does not exist. {_OVERRIDE_HINT}")
        rows = load_dataset("json", data_files=path, split="train").to_list()
        return _validate(rows, path)
    try:
        rows = load_dataset(path_or_id, split=split).to_list()
    except Exception as err:  # hub errors come from several libraries (requests, httpx, datasets)
        raise OSError(
            f"Could not load dataset {path_or_id!r} (split {split!r}) from the Hugging Face hub: it is "
            f"unreachable or the id does not exist. {_OVERRIDE_HINT} Original error: {err}"
        ) from err
    return _validate(rows, path_or_id)
