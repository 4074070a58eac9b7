"""The registry of evaluation sets and groups, and loading their rows into one schema.

Every loaded row has ``instruction`` + ``input`` (the prompt, formatted by the Alpaca template or the chat
template like training data) or ``prompt`` (ESFT: used verbatim), and ``answer`` (gold; may be missing or
bad: scoring names such rows). The fourteen LLM-Adapters test files are read from the data directory
(``eval.data_dir``, default ``$MOE_LAB_DATA_DIR``, else the copy shipped in ``moe_lab/data/files/llm_adapters``); every set can be read from
a local file instead with ``eval.paths.<name>=/local/file`` (``.json``, ``.jsonl``, ``.parquet``, ``.txt``
for perplexity, or a directory written by ``datasets.save_to_disk``).
"""

from __future__ import annotations

import functools
import json
import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from ..data.shipped import LLM_ADAPTERS_DIR
from .choices import hellaswag_row

DEFAULT_DATA_DIR = str(LLM_ADAPTERS_DIR)
#: The instruction suffix of hard-reasoning prompts (DeepSeek-R1's evaluation prompt).
BOXED_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."


class EvalSetUnavailable(OSError):
    """An evaluation set that cannot be read here (no local copy, hub unreachable)."""


@dataclass(frozen=True)
class EvalSet:
    """One evaluation set.

    kind: ``math_numeric`` | ``math_letter`` | ``commonsense`` | ``boxed`` (AIME, MATH-500) |
    ``choice_letter`` (GPQA) | ``perplexity`` | ``esft_intent`` | ``esft_reference``.
    """

    name: str
    kind: str
    title: str  # column header in results tables
    file: str | None = None  # file in the LLM-Adapters data directory
    hub: str | None = None
    hub_config: str | None = None
    split: str = "test"
    answer_format: str | None = None  # commonsense: a key of choices.FORMATS
    source_url: str | None = None  # where to get sets that are on no hub
    aliases: tuple[str, ...] = field(default=())

    @property
    def metric(self) -> str:
        return {"perplexity": "ppl", "esft_reference": "rouge_l", "esft_intent": "intent_em",
                "boxed": "pass@1", "choice_letter": "pass@1"}.get(self.kind, "acc")

    @property
    def generative(self) -> bool:
        return self.kind != "perplexity"


_ESFT_URL = "https://github.com/deepseek-ai/ESFT (datasets/eval/{task}.jsonl)"

EVAL_SETS: dict[str, EvalSet] = {
    s.name: s
    for s in (
        EvalSet("gsm8k", "math_numeric", "GSM8K", file="gsm8k.test.json"),
        EvalSet("svamp", "math_numeric", "SVAMP", file="SVAMP.test.json"),
        EvalSet("multiarith", "math_numeric", "MultiArith", file="MultiArith.test.json"),
        EvalSet("addsub", "math_numeric", "AddSub", file="AddSub.test.json"),
        EvalSet("aqua", "math_letter", "AQuA", file="AQuA.test.json"),
        EvalSet("singleeq", "math_numeric", "SingleEq", file="SingleEq.test.json"),
        EvalSet("mawps", "math_numeric", "MAWPS", file="mawps.test.json"),
        EvalSet("boolq", "commonsense", "BoolQ", file="boolq.test.json", answer_format="true_false"),
        EvalSet("piqa", "commonsense", "PIQA", file="piqa.test.json", answer_format="solution"),
        EvalSet("siqa", "commonsense", "SIQA", file="social_i_qa.test.json", answer_format="answer",
                aliases=("social_i_qa", "social_iqa")),
        EvalSet("hellaswag", "commonsense", "HellaSwag", hub="Rowan/hellaswag", split="validation",
                answer_format="ending"),
        EvalSet("winogrande", "commonsense", "WinoGrande", file="winogrande.test.json", answer_format="option"),
        EvalSet("arc_e", "commonsense", "ARC-e", file="ARC-Easy.test.json", answer_format="answer",
                aliases=("arc-easy", "arc_easy")),
        EvalSet("arc_c", "commonsense", "ARC-c", file="ARC-Challenge.test.json", answer_format="answer",
                aliases=("arc-challenge", "arc_challenge")),
        EvalSet("obqa", "commonsense", "OBQA", file="openbookqa.test.json", answer_format="answer",
                aliases=("openbookqa",)),
        EvalSet("aime24", "boxed", "AIME24", hub="HuggingFaceH4/aime_2024", split="train"),
        EvalSet("aime25", "boxed", "AIME25", hub="yentinglin/aime_2025", split="train"),
        EvalSet("gpqa_diamond", "choice_letter", "GPQA-Diamond", hub="Idavidrein/gpqa",
                hub_config="gpqa_diamond", split="train"),
        EvalSet("math500", "boxed", "MATH-500", hub="HuggingFaceH4/MATH-500", split="test"),
        EvalSet("wikitext2", "perplexity", "WikiText-2", hub="Salesforce/wikitext",
                hub_config="wikitext-2-raw-v1", split="test"),
        EvalSet("esft_intent", "esft_intent", "Intent", source_url=_ESFT_URL.format(task="intent")),
        EvalSet("esft_law", "esft_reference", "Law", source_url=_ESFT_URL.format(task="law")),
        EvalSet("esft_summary", "esft_reference", "Summary", source_url=_ESFT_URL.format(task="summary")),
        EvalSet("esft_translation", "esft_reference", "Translation",
                source_url=_ESFT_URL.format(task="translation")),
    )
}

GROUPS: dict[str, list[str]] = {
    "math7": ["gsm8k", "svamp", "multiarith", "addsub", "aqua", "singleeq", "mawps"],
    "commonsense8": ["boolq", "piqa", "siqa", "hellaswag", "winogrande", "arc_e", "arc_c", "obqa"],
    "hard_reasoning": ["aime24", "aime25", "gpqa_diamond", "math500"],
    "ppl": ["wikitext2"],
    "esft": ["esft_intent", "esft_law", "esft_summary", "esft_translation"],
}


def _aliases() -> dict[str, str]:
    table = {}
    for s in EVAL_SETS.values():
        for alias in (s.name, *s.aliases, *([Path(s.file).name.split(".")[0]] if s.file else [])):
            table[alias.lower()] = s.name
    return table


def get_eval_set(name: str) -> EvalSet:
    """The set called ``name`` (or an alias such as the file stem ``ARC-Easy``); lists valid names if unknown."""
    key = _aliases().get(str(name).lower())
    if key is None:
        raise ValueError(f"unknown evaluation set {name!r}: choose one of {', '.join(EVAL_SETS)} "
                         f"(or a group: {', '.join(GROUPS)})")
    return EVAL_SETS[key]


def resolve(names) -> list[EvalSet]:
    """Sets named by set or group names, in order, without duplicates."""
    if isinstance(names, str):
        names = [names]
    out: list[EvalSet] = []
    for name in names:
        for member in GROUPS.get(str(name), [name]):
            s = get_eval_set(member)
            if s not in out:
                out.append(s)
    return out


def data_dir(value: str | os.PathLike | None = None) -> Path:
    """``value``, else ``$MOE_LAB_DATA_DIR``, else the packaged LLM-Adapters folder."""
    return Path(value or os.environ.get("MOE_LAB_DATA_DIR") or DEFAULT_DATA_DIR).expanduser()


@dataclass
class EvalData:
    """The rows of one set and where they came from (for naming rows in messages)."""

    spec: EvalSet
    rows: list[dict]
    source: str
    text: str | None = None  # perplexity: the whole evaluation text
    _lines: list[int] | None = None

    def where(self, i: int) -> str:
        """``<file>: row <i> (line <n>)`` for local JSON files, ``<source>: row <i>`` otherwise."""
        if self._lines is None:
            self._lines = []
            if self.source.endswith((".json", ".jsonl")) and os.path.isfile(self.source):
                from ..data.llm_adapters import row_start_lines

                self._lines = row_start_lines(self.source)
        line = f" (line {self._lines[i]})" if i < len(self._lines) else ""
        return f"{self.source}: row {i}{line}"


def _read_local(path: Path) -> list[dict]:
    if path.is_dir():
        import datasets

        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[next(iter(loaded))]
        return loaded.to_list()
    if path.suffix == ".json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON array of rows")
        return data
    if path.suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}: line {n} is not valid JSON ({err.msg})") from None
        return rows
    if path.suffix == ".parquet":
        import datasets

        return datasets.load_dataset("parquet", data_files=str(path), split="train").to_list()
    raise ValueError(f"{path}: unsupported file type {path.suffix!r} (use .json, .jsonl, .parquet or a "
                     "save_to_disk directory)")


@functools.lru_cache(maxsize=1)
def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached (a 3 s connection test), or None when it may be (or when the hub
    client is in offline mode, reading its cache, or a proxy decides). Spares the client's retries offline."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:  # the value the client really uses (read when it was first imported)
        return None
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as err:
        return f"{host} is unreachable: {err}; if the set is in the local HF cache, set HF_HUB_OFFLINE=1"
    return None


def _read_hub(spec: EvalSet) -> list[dict]:
    hint = (f"Download it where there is internet and set eval.paths.{spec.name}=/local/path "
            "(.json/.jsonl/.parquet file or a save_to_disk directory).")
    need = f"evaluation set {spec.name!r} needs {spec.hub!r} ({spec.hub_config or 'default'} config, split " \
           f"{spec.split!r}) from the Hugging Face hub"
    reason = _hub_unreachable()
    if reason:
        raise EvalSetUnavailable(f"{need}, and {reason}. {hint}")
    import datasets

    try:
        return datasets.load_dataset(spec.hub, spec.hub_config, split=spec.split).to_list()
    except Exception as err:  # noqa: BLE001 (offline / missing: errors come from several libraries)
        raise EvalSetUnavailable(f"{need}, which could not be read ({err.__class__.__name__}). {hint}") from None


def _normalize(spec: EvalSet, rows: list[dict], seed: int) -> list[dict]:
    """Rows of any supported source format in the common schema (see module docstring)."""
    rows = [_with_id(r) for r in rows]
    if spec.kind == "commonsense" and rows and "instruction" not in rows[0] and "endings" in rows[0]:
        return [hellaswag_row(r) for r in rows]
    if spec.kind == "boxed" and rows and "instruction" not in rows[0]:
        return [{"instruction": (r.get("problem") or r["question"]) + BOXED_SUFFIX, "input": "",
                 "answer": None if r.get("answer") is None else str(r["answer"]), **_id(r)} for r in rows]
    if spec.kind == "choice_letter" and rows and "instruction" not in rows[0]:
        return [{**_gpqa_row(r, random.Random(f"{seed}-{i}")), **_id(r)} for i, r in enumerate(rows)]
    if spec.kind.startswith("esft") and rows and "prompt" in rows[0]:
        return [{"prompt": r["prompt"], "answer": (r.get("raw_answers") or r.get("answers") or [None])[0],
                 **_id(r)} for r in rows]
    return rows


_ID_FIELDS = ("id", "idx", "unique_id", "Record ID")


def _id(row: dict) -> dict:
    """``{"id": <the row's own id>}`` from the first id-like field present, else ``{}``."""
    for key in _ID_FIELDS:
        if row.get(key) is not None:
            return {"id": row[key]}
    return {}


def _with_id(row: dict) -> dict:
    return row if "id" in row or not _id(row) else {**row, **_id(row)}


def row_ids(data: EvalData) -> list:
    """The id of each row: the rows' own ``id`` when every row has a distinct one, else the row index."""
    own = [r.get("id") for r in data.rows]
    if own and all(i is not None for i in own) and len({str(i) for i in own}) == len(own):
        return own
    return list(range(len(data.rows)))


def _gpqa_row(row: dict, rng: random.Random) -> dict:
    options = [row["Correct Answer"], row["Incorrect Answer 1"], row["Incorrect Answer 2"],
               row["Incorrect Answer 3"]]
    order = list(range(4))
    rng.shuffle(order)
    letters = "ABCD"
    body = "\n".join(f"{letters[k]}) {str(options[j]).strip()}" for k, j in enumerate(order))
    instruction = (f"{row['Question'].strip()}\n\n{body}{BOXED_SUFFIX[:-1]} as the letter of the correct "
                   "option.")
    return {"instruction": instruction, "input": "", "answer": letters[order.index(0)]}


def _ppl_text(path: Path | None, rows: list[dict] | None) -> str:
    if path is not None and path.suffix == ".txt":
        return path.read_text(encoding="utf-8")
    return "\n\n".join(r["text"] for r in rows)  # the HF perplexity convention for WikiText


def load_eval_set(spec: EvalSet | str, data_dir_: str | os.PathLike | None = None,
                  path: str | os.PathLike | None = None, seed: int = 0) -> EvalData:
    """Read ``spec``'s rows: from ``path`` if given, else its LLM-Adapters file in ``data_dir_``, else the hub.

    Raises ``FileNotFoundError`` naming the data directory and the ``eval.paths.<name>`` override for a
    missing file, and :class:`EvalSetUnavailable` naming the override when the hub cannot be read.
    ``seed`` fixes GPQA's option order.
    """
    spec = get_eval_set(spec) if isinstance(spec, str) else spec
    if path is not None:
        local = Path(path).expanduser()
        if not local.exists():
            raise FileNotFoundError(f"eval.paths.{spec.name}={path}: no such file or directory")
        rows = None if local.suffix == ".txt" else _read_local(local)
        source = str(local)
    elif spec.file is not None:
        local = data_dir(data_dir_) / spec.file
        if not local.is_file():
            raise FileNotFoundError(
                f"evaluation set {spec.name!r}: {local} does not exist. Point eval.data_dir (or the "
                f"MOE_LAB_DATA_DIR environment variable) to the LLM-Adapters data folder, or set "
                f"eval.paths.{spec.name}=/local/{spec.file}"
            )
        rows, source = _read_local(local), str(local)
    elif spec.hub is not None:
        local, rows, source = None, _read_hub(spec), f"{spec.hub}[{spec.split}]"
    else:
        raise EvalSetUnavailable(
            f"evaluation set {spec.name!r} is on no hub: download it from {spec.source_url} and set "
            f"eval.paths.{spec.name}=/local/{spec.name.removeprefix('esft_')}.jsonl"
        )
    if spec.kind == "perplexity":
        return EvalData(spec, [], source, text=_ppl_text(local, rows))
    return EvalData(spec, _normalize(spec, rows, seed), source)
