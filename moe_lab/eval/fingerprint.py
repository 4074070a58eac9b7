"""A cheap fingerprint of a model's weights, recorded with an evaluation's predictions so that a resumed run never
mixes predictions of two models (an ``export/`` rewritten between the interrupted and the resumed run); and the
fingerprint of an eval set's contents (:func:`rows_fingerprint`: the same set name with other rows is another set).

Hashing every byte of a multi-GB checkpoint on each resume would cost minutes; instead, per weights file: its
name, its size, its safetensors header (tensor names, dtypes, shapes) and the first and last MiB of its bytes, plus
the whole of the small JSON files (config, shard index). A re-trained, re-compressed or re-exported model differs
in those bytes (any training step changes every tensor; the first and last MiB hold whole tensors of the embedding
and the head/last layer); a copy, with or without its timestamps, keeps the fingerprint (mtimes are not used)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

SAMPLE = 1 << 20
WEIGHTS = (".safetensors", ".bin", ".pt", ".ckpt", ".pth")
SMALL = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "compress_manifest.json",
         "condense_manifest.json", "generation_config.json")


def _file_digest(path: Path, sha) -> None:
    size = path.stat().st_size
    sha.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        sha.update(f.read(SAMPLE))
        if size > SAMPLE:
            f.seek(max(SAMPLE, size - SAMPLE))
            sha.update(f.read(SAMPLE))


def weights_fingerprint(source) -> str | None:
    """The fingerprint of a local model directory or checkpoint file (see module docstring); None for anything
    else (a hub id: its revision identifies it)."""
    path = Path(str(source)).expanduser()
    sha = hashlib.sha256()
    if path.is_file():
        _file_digest(path, sha)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and (p.suffix in WEIGHTS or p.name in SMALL))
        for p in files:
            if p.name in SMALL:
                sha.update(f"{p.relative_to(path)}\0".encode() + p.read_bytes())
            else:
                _file_digest(p, sha)
    else:
        return None
    return sha.hexdigest()[:16]


def model_fingerprint(checkpoint, model_cfg: dict) -> str:
    """``task.checkpoint``'s fingerprint, else ``model.pretrained``'s, else (a randomly initialised model) the
    hash of its config entry, which with its seed determines the weights."""
    for source in (checkpoint, model_cfg.get("pretrained")):
        if source is not None:
            found = weights_fingerprint(source)
            if found is not None:
                return found
    return hashlib.sha256(json.dumps(model_cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def rows_fingerprint(rows: list[dict], text: str | None = None) -> str:
    """The hash of an eval set's contents: every row (keys sorted) and, for a perplexity set, its text. A set
    rewritten with other rows or answers under the same name has another fingerprint."""
    sha = hashlib.sha256()
    for row in rows:
        sha.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode() + b"\n")
    if text is not None:
        sha.update(text.encode())
    return sha.hexdigest()[:16]
