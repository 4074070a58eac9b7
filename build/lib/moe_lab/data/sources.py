"""Read dataset rows from a local file or folder, a URL, or a Hugging Face hub id, through ``datasets``.

One place decides where rows come from and how a bad row is reported (file, line, field), so every
format (LLM-Adapters, chat messages, reasoning traces, plain text) gives the same errors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from datasets import load_dataset, load_from_disk

#: File suffix -> ``datasets`` builder for local files and URLs.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}
_DATASET_FOLDER_MARKERS = ("dataset_info.json", "state.json")


def override_hint(example: str = "/local/file.json") -> str:
    """The Hydra override that points a dataset config at a local copy."""
    return f"Point to a local copy with the Hydra override `dataset.path={example}`."


def is_url(path_or_id: str) -> bool:
    return path_or_id.startswith(("http://", "https://"))


def is_local(path_or_id: str) -> bool:
    """A local path (absolute, ./ or ~, an existing path, or a data-file name), not a hub id or URL."""
    if is_url(path_or_id):
        return False
    return (
        path_or_id.endswith(tuple(FILE_BUILDERS))
        or os.path.isabs(path_or_id)
        or path_or_id.startswith((".", "~"))
        or os.path.exists(path_or_id)
    )


def _builder(path: str) -> str:
    for suffix, builder in FILE_BUILDERS.items():
        if path.endswith(suffix):
            return builder
    raise ValueError(
        f"Cannot tell the format of {path!r}: use one of {', '.join(FILE_BUILDERS)} (or a dataset folder)."
    )


def row_start_lines(path: str) -> list[int]:
    """1-based line where each row of a JSON array or JSON-lines file starts (blank lines are skipped)."""
    problem = encoding_error(path)
    if problem is not None:
        raise ValueError(problem)
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


def where(source: str, i: int) -> str:
    """``"<file>: row i starting at line n"`` for JSON/JSONL files, else ``"<source>: row i"``."""
    if os.path.isfile(source) and source.endswith((".json", ".jsonl")):
        return f"{source}: row {i} starting at line {row_start_lines(source)[i]}"
    return f"{source}: row {i}"


def _is_empty(path: str) -> bool:
    """A file with no rows: zero bytes, only whitespace, or an empty JSON array."""
    if os.path.getsize(path) > (1 << 16):
        return False
    with open(path, "rb") as f:
        text = f.read().strip()
    return not text or (path.endswith((".json", ".jsonl")) and text.replace(b" ", b"") in (b"[]", b"{}"))


def encoding_error(path: str) -> str | None:
    """``"<file>: line n, column c: ..."`` for the first bytes of ``path`` that are not UTF-8, or None."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        return (f"{path}: line {line}, column {column}: bytes {data[err.start:err.end]!r} are not UTF-8 ({err.reason}); "
                f"dataset files are read as UTF-8: convert it from its encoding, e.g. "
                f"iconv -f latin1 -t utf-8 {path} > {path}.utf8")
    return None


def json_syntax_error(path: str) -> str | None:
    """``"<file>: line n, column c: <problem>"`` for the first JSON syntax error of a JSON/JSON-lines file (or its
    first bytes that are not UTF-8), or None."""
    problem = encoding_error(path)
    if problem is not None:
        return problem
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return f"{path}: line {err.lineno}, column {err.colno}: invalid JSON ({err.msg})"
        return None
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                return f"{path}: line {number}, column {err.colno}: invalid JSON ({err.msg})"
    return None


def _hub_error(path_or_id: str, name: str | None, split: str, err: Exception, example: str) -> OSError:
    if is_url(path_or_id):
        what = f"{path_or_id} from the web"
    else:
        config = "" if name is None else f", config {name!r}"
        what = f"{path_or_id} ({f'split {split!r}'}{config}) from the Hugging Face hub"
    return OSError(
        f"Could not load dataset {what}: it is unreachable (offline?) or does not exist. "
        f"{override_hint(example)} Original error: {type(err).__name__}: {err}"
    )


def open_dataset(
    path_or_id: str,
    split: str = "train",
    name: str | None = None,
    streaming: bool = False,
    example: str = "/local/file.json",
):
    """A ``datasets`` Dataset (or IterableDataset when ``streaming``) for a file, folder, URL or hub id.

    Local files are read with the builder for their suffix (``.json``/``.jsonl``/``.parquet``/``.txt``/``.csv``;
    ``split`` and ``name`` are ignored); a folder written by ``save_to_disk`` is loaded with ``load_from_disk``;
    any other folder, a URL or a hub id goes through ``load_dataset`` with ``name`` and ``split``.
    A missing local path raises ``FileNotFoundError``; an unreachable URL or hub id raises ``OSError``; both
    name the ``dataset.path=<example>`` override.
    """
    if is_local(path_or_id):
        path = os.path.expanduser(path_or_id)
        if not os.path.exists(path):
            where_from = "" if os.path.isabs(path) else (
                f" (a relative path is read from the working directory {os.getcwd()}; the LLM-Adapters data "
                "folder is $MOE_LAB_DATA_DIR: export MOE_LAB_DATA_DIR=/abs/path/to/llm_adapters)")
            raise FileNotFoundError(f"Dataset path {path_or_id!r} does not exist{where_from}. "
                                    f"{override_hint(example)}")
        if os.path.isfile(path) and _is_empty(path):
            raise ValueError(f"Dataset file {path} is empty (no rows). {override_hint(example)}")
        if os.path.isfile(path):
            try:
                return load_dataset(_builder(path), data_files=path, split="train", streaming=streaming)
            except Exception as err:
                problem = json_syntax_error(path) if path.endswith((".json", ".jsonl")) else encoding_error(path)
                if problem is None:
                    raise
                raise ValueError(problem) from err
        if all(os.path.exists(os.path.join(path, m)) for m in _DATASET_FOLDER_MARKERS):
            ds = load_from_disk(path)
            ds = ds[split] if hasattr(ds, "keys") else ds
            return ds.to_iterable_dataset() if streaming else ds
        return load_dataset(path, name, split=split, streaming=streaming)
    try:
        if is_url(path_or_id):
            return load_dataset(_builder(path_or_id), data_files=path_or_id, split="train", streaming=streaming)
        return load_dataset(path_or_id, name, split=split, streaming=streaming)
    except Exception as err:  # hub errors come from several libraries (requests, httpx, huggingface_hub)
        raise _hub_error(path_or_id, name, split, err, example) from err


def read_rows(
    path_or_id: str, split: str = "train", name: str | None = None, example: str = "/local/file.json"
) -> list[dict]:
    """All rows of ``open_dataset(path_or_id, split, name)`` as a list of dicts."""
    with _named_encoding_errors(path_or_id):
        return open_dataset(path_or_id, split=split, name=name, example=example).to_list()


@contextmanager
def _named_encoding_errors(path_or_id: str):
    """A local file's bytes that are not UTF-8, found when its rows are read (pyarrow keeps them until then, a
    streamed file decodes as it goes): ``ValueError`` naming the file, line and column."""
    try:
        yield
    except UnicodeDecodeError as err:
        path = os.path.expanduser(path_or_id)
        problem = encoding_error(path) if is_local(path_or_id) and os.path.isfile(path) else None
        if problem is None:
            raise
        raise ValueError(problem) from err


def stream_rows(
    path_or_id: str,
    split: str = "train",
    name: str | None = None,
    streaming: bool = True,
    example: str = "/local/file.txt",
) -> Iterator[dict]:
    """Rows one at a time (``streaming=True`` reads a hub dataset without downloading all of it)."""
    ds: Iterable[dict] = open_dataset(path_or_id, split=split, name=name, streaming=streaming, example=example)
    with _named_encoding_errors(path_or_id):
        yield from ds


def source_label(path_or_id: str) -> str:
    """How errors name the source: the expanded local path, or the URL/hub id as given."""
    return os.path.expanduser(path_or_id) if is_local(path_or_id) else path_or_id
