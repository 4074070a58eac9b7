"""A paper's reported table next to ours, cell by cell: ``python -m experiments.collect <paper> RESULTS...``.

``<paper>`` names a folder of ``experiments/`` holding ``reported.csv`` (one line per paper cell: table,
paper_model, model, paper_row, row, train, eval, benchmark, metric, value, source, flag). ``value`` is the paper's
number as printed, ``source`` names its table, row and column (or says why there is none), ``flag`` says what is
wrong with a printed number (an Avg. that is not its row's mean, a likely-swapped cell); flagged paper values are
marked ``!`` and their flags listed under the table. RESULTS are
``task=evaluate`` run directories (``summary.json``) or sweep directories (``multirun/<...>/`` with
``multirun.yaml`` and numbered job directories). A result cell matches a paper cell when

- ``model`` / ``row`` equal the model and method labels of the evaluated run (the ``model.name`` and
  ``method.name`` of the run that wrote the checkpoint),
- ``train`` equals the training run's ``dataset=`` choice (from its ``.hydra/hydra.yaml``; empty for a model
  evaluated without a checkpoint),
- ``eval`` (``key=value;...``, may be empty) holds on the evaluation run's ``eval.`` config, updated by the
  ``eval_settings`` its ``summary.json`` may record (``task=condense``: ``layers``, ``routed_experts``, ...),
- ``benchmark`` is the results-table column (``GSM8K``, ``Avg.``, ...).

``--as OURS=PAPER`` renames our labels before matching (a tiny stand-in: ``--as tiny_olmoe=olmoe_0125``).
Where a paper's ``Avg.`` is a mean over lm-eval's own (hub) tasks (``HUB_AVERAGES``), our average is shown only if
its tasks are hub tasks too (the ``task_source`` a run's summary records, or its ``eval.lm_eval`` tasks); a mean
over moe-lab's ``llm_adapters_*`` tasks or moe-lab eval sets prints ``n/a`` with a footnote.
Paper cells without a value (not in the specs) print ``n/a``; the difference is ours - paper, in points,
and ``n/a`` where either side is missing or the metrics differ. Results on ``eval.limit`` rows are marked *.
A paper with a normalised-performance column (``NORMALISE``: Compressed Experts, method / full top-k) gets one
``Normalised`` line per row: 100 x the row's mean over its benchmarks / the same model's top-k row's mean over
the same benchmarks, the paper's and ours apart (``n/a`` where a cell of either row is missing). The paper's own
printed normalised cells (paper_row ``Norm. Perf.``) get ours per column: 100 x our cell of that row label / our
reference row's cell. Cost tables (``COST_TABLES``: latency, offload timing, FLOPs, training time) get no
Normalised line; their cells of ours come from ``bench/`` scripts' ``summary.json`` (no checkpoint: train empty).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from moe_lab.eval.eval_sets import EVAL_SETS
from moe_lab.eval.results import AVERAGE, ResultsTable, expand_runs

PAPERS_DIR = Path(__file__).resolve().parent
FIELDS = ("table", "paper_model", "model", "paper_row", "row", "train", "eval", "benchmark", "metric", "value",
          "source", "flag")
OUT_FIELDS = ("table", "model", "method", "train", "benchmark", "metric", "paper", "ours", "diff", "limit", "partial",
              "run", "note", "flag")
_METRIC = {s.title: s.metric for s in EVAL_SETS.values()}
# papers whose Avg. is a mean of lm-eval hub tasks (their data and prompts, not the LLM-Adapters files)
HUB_AVERAGES = {"condense": "compression spec 3.9: lm-eval zero-shot, 8 tasks",
                "moe_to_dense": "compression spec 2.11: five lm-eval hub tasks"}
# papers with a normalised-performance column: the paper_row it divides by (finetuning spec 3: method / full top-k)
NORMALISE = {"compressed_experts": "Top-k SFT"}
NORMALISED = "Normalised"  # the benchmark label of a row's normalised-performance line
PRINTED_NORMALISED = "Norm. Perf."  # the paper_row of a paper's printed normalised cells (metric "% of <reference>")
# tables of costs (seconds, hours, FLOPs), not scores: no Normalised line (their cells come from bench/ summaries)
COST_TABLES = {"Latency", "Offload timing", "FLOPs", "Training time"}


@dataclass(frozen=True)
class Ours:
    """One cell of our results with where it came from."""

    model: str
    method: str
    train: str | None  # the training run's dataset choice; "" = no checkpoint; None = unknown
    benchmark: str
    value: float | None
    limit: int | None
    run: Path
    eval_cfg: dict
    partial: bool = False  # an average over fewer sets than the run's table has (some skipped)
    source: str | None = None  # the table's tasks: hub, llm_adapters, moe_lab (eval sets), mixed; None = unknown


def papers() -> list[str]:
    return sorted(p.parent.name for p in PAPERS_DIR.glob("*/reported.csv"))


def load_reported(paper: str, path: str | Path | None = None) -> list[dict]:
    """The rows of ``experiments/<paper>/reported.csv`` or of ``path`` (``value`` as float or None)."""
    path = Path(path) if path is not None else PAPERS_DIR / paper / "reported.csv"
    if not path.is_file():
        raise FileNotFoundError(f"no {path}: choose a paper from {', '.join(papers())}")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) not in (FIELDS, FIELDS[:-1]):  # the flag column may be left out
            raise ValueError(f"{path}: the header must be {','.join(FIELDS)}, found {reader.fieldnames}")
        rows = list(reader)
    for n, row in enumerate(rows, 2):
        row["flag"] = row.get("flag") or ""
        try:
            row["value"] = float(row["value"]) if row["value"].strip() else None
        except ValueError:
            raise ValueError(f"{path} line {n}: value {row['value']!r} is not a number (leave it empty if "
                             "the paper's number is not known)") from None
    return rows


# ----------------------------------------------------------------------------------------------------
# Our results


def _summary(path: Path) -> dict | None:
    try:
        return json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def eval_runs(paths) -> list[Path]:
    """``task=evaluate`` run directories: each path is one, or a sweep directory whose evaluate jobs are taken
    in Hydra job order (``moe_lab.eval.results.expand_runs``). Anything else is an error that says what to pass."""
    runs = []
    for arg in paths:
        found = expand_runs([arg])
        if not found:
            raise ValueError(f"{arg} holds no task=evaluate run (a finetune sweep? evaluate its exports first: "
                             "python run.py -m task=evaluate experiment=<preset> task.checkpoint=<sweep>/0_.../export,...)")
        for run in found:
            summary = _summary(run)
            if summary is None:
                raise FileNotFoundError(f"{run}: neither a task=evaluate run directory (summary.json) nor a sweep "
                                        "of them")
            if "table" not in summary:
                raise ValueError(f"{run} is not a task=evaluate run (its summary.json has no results table): "
                                 f"evaluate it first (python run.py task=evaluate task.checkpoint={run}/export ...; "
                                 "a task=condense run: run it with condense.eval.tasks=[...])")
        runs.extend(found)
    return runs


def _training_run(checkpoint: str | None, eval_run: Path) -> Path | None:
    """The run directory that wrote ``checkpoint`` (``<run>/export`` or ``<run>/checkpoints/x.ckpt``)."""
    if checkpoint is None:
        return None
    path = Path(checkpoint)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, *(p / path for p in eval_run.parents)]
    for candidate in candidates:
        if candidate.exists():
            return candidate.parent if candidate.is_dir() else candidate.parent.parent
    return None


def train_choice(checkpoint: str | None, eval_run: Path) -> str | None:
    """The ``dataset=`` choice of the run that wrote ``checkpoint``; "" without a checkpoint; None if unknown."""
    if checkpoint is None:
        return ""
    run = _training_run(checkpoint, eval_run)
    hydra_yaml = run / ".hydra" / "hydra.yaml" if run is not None else None
    if hydra_yaml is None or not hydra_yaml.is_file():
        return None
    return OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.runtime.choices.dataset")


def load_ours(runs, aliases: dict[str, str] | None = None) -> list[Ours]:
    """Every cell (and row average) of the given evaluate runs, labels renamed by ``aliases``."""
    rename = (aliases or {}).get
    cells = []
    for run in runs:
        summary = _summary(run)
        table = ResultsTable.from_json(summary["table"], summary.get("columns"))
        config = run / "config.yaml"
        eval_node = OmegaConf.select(OmegaConf.load(config), "eval") if config.is_file() else None
        eval_cfg = OmegaConf.to_container(eval_node) if eval_node is not None else {}
        # a run that records what it evaluated (task=condense: layers condensed, S/SR, selections) beside it
        eval_cfg = {**eval_cfg, **summary.get("eval_settings", {})}
        source = eval_cfg.get("task_source") or _config_source(eval_cfg)
        train = train_choice(summary.get("checkpoint"), run)
        train = rename(train, train) if train else train
        for key, row in table.cells.items():
            values = dict(row)
            average, n = table.average(key)
            if table.averaged:
                values[AVERAGE] = average
            for column, value in values.items():
                cells.append(Ours(rename(key[0], key[0]), rename(key[1], key[1]), train, column, value,
                                  summary.get("limit"), run, eval_cfg,
                                  partial=column == AVERAGE and n < table.n_averaged, source=source))
    return cells


def _config_source(eval_cfg: dict) -> str | None:
    """The task source of a task=evaluate run from its ``eval`` config: moe-lab eval sets (``eval.datasets``)
    and/or lm-eval tasks (``eval.lm_eval.tasks``, hub or ``llm_adapters_*``); None when neither is recorded."""
    sources = {"moe_lab"} if eval_cfg.get("datasets") else set()
    tasks = [spec["task"] for spec in ((eval_cfg.get("lm_eval") or {}).get("tasks") or {}).values()]
    if tasks:
        from moe_lab.eval.lm_eval_table import task_source

        sources.add(task_source(tasks))
    return None if not sources else sources.pop() if len(sources) == 1 else "mixed"


# ----------------------------------------------------------------------------------------------------
# Matching


def _eval_holds(conditions: str, eval_cfg: dict) -> bool:
    """``"generation.temperature=0.6;datasets=..."`` against an evaluation run's ``eval`` config."""
    cfg = OmegaConf.create(eval_cfg)
    for condition in filter(None, (c.strip() for c in conditions.split(";"))):
        key, _, expected = condition.partition("=")
        actual = OmegaConf.select(cfg, key.strip())
        try:
            if float(actual) != float(expected):
                return False
        except (TypeError, ValueError):
            if str(actual) != expected.strip():
                return False
    return True


def _matches(paper: dict, ours: Ours) -> bool:
    return (paper["paper_row"] != PRINTED_NORMALISED and ours.model == paper["model"] and ours.method == paper["row"]
            and ours.benchmark == paper["benchmark"] and ours.train == paper["train"]
            and _eval_holds(paper["eval"], ours.eval_cfg))


def compare(reported: list[dict], ours: list[Ours], all_tables: bool = False, hub_average: bool = False,
            normalise_to: str | None = None) -> tuple[list[dict], list[Ours]]:
    """(comparison rows in ``OUT_FIELDS``, our cells that match no paper cell).

    Only the rows (table, model, method) with at least one of our cells are listed unless ``all_tables``
    (then every paper cell is); where several of our runs
    match one paper cell the last one given wins (and a warning names both). With ``hub_average`` (the paper's
    ``Avg.`` is over lm-eval hub tasks) an average of ours over other tasks is withheld (``note`` names them).
    With ``normalise_to`` (a paper row label) every row gets a ``normalised`` line (see there)."""
    used: set[int] = set()
    rows = []
    for paper in reported:
        hits = [k for k, cell in enumerate(ours) if _matches(paper, cell)]
        used.update(hits)
        if len(hits) > 1:
            names = ", ".join(str(ours[k].run) for k in hits)
            print(f"warning: {paper['table']} / {paper['row']} / {paper['benchmark']}: several results ({names}); "
                  "the last is shown", file=sys.stderr)
        mine = ours[hits[-1]] if hits else None
        value = None if mine is None else mine.value
        note = ""
        if hub_average and mine is not None and paper["benchmark"] == AVERAGE and mine.source != "hub":
            value, note = None, f"ours averages {mine.source or 'unrecorded'} tasks, the paper lm-eval hub tasks"
        our_metric = _METRIC.get(paper["benchmark"], paper["metric"])
        comparable = our_metric == paper["metric"]
        diff = value - paper["value"] if comparable and value is not None and paper["value"] is not None else None
        rows.append({
            "table": paper["table"], "model": paper["paper_model"], "method": paper["paper_row"],
            "train": paper["train"], "benchmark": paper["benchmark"],
            "metric": paper["metric"] if comparable else f"{paper['metric']} (ours: {our_metric})",
            "paper": paper["value"], "ours": value, "diff": diff,
            "limit": None if mine is None else mine.limit, "run": None if mine is None else str(mine.run),
            "partial": mine is not None and mine.partial, "note": note, "flag": paper.get("flag", ""),
        })
    if normalise_to is not None:
        rows = printed_normalised(rows, reported, normalise_to)
        rows = normalised(rows, normalise_to)
    if not all_tables:
        shown = {(r["table"], r["model"], r["method"]) for r in rows if r["run"] is not None}
        rows = [r for r in rows if (r["table"], r["model"], r["method"]) in shown]
    return rows, [cell for k, cell in enumerate(ours) if k not in used]


def _mean(values: list) -> float | None:
    return None if not values or any(v is None for v in values) else sum(values) / len(values)


def printed_normalised(rows: list[dict], reported: list[dict], reference: str) -> list[dict]:
    """``rows`` (one per ``reported`` cell, in its order) with ours filled in on the paper's printed normalised
    cells (paper_row ``Norm. Perf.``): 100 x our cell of the same table, model, row label, training set and benchmark
    / our cell of the ``reference`` row there; None where either is missing."""
    def key(cell: dict) -> tuple:
        return cell["table"], cell["paper_model"], cell["train"], cell["benchmark"]

    scores = {(key(c), c["row"]): r for c, r in zip(reported, rows) if c["paper_row"] != PRINTED_NORMALISED}
    refs = {key(c): r for c, r in zip(reported, rows) if c["paper_row"] == reference}
    out = []
    for cell, row in zip(reported, rows):
        if cell["paper_row"] == PRINTED_NORMALISED:
            mine, ref = scores.get((key(cell), cell["row"])), refs.get(key(cell))
            num, den = (None if r is None else r["ours"] for r in (mine, ref))
            value = 100.0 * num / den if num is not None and den else None
            row = {**row, "metric": cell["metric"], "ours": value, "run": mine["run"] if value is not None else None,
                   "limit": mine["limit"] if value is not None else None,
                   "diff": value - row["paper"] if value is not None and row["paper"] is not None else None}
        out.append(row)
    return out


def normalised(rows: list[dict], reference: str) -> list[dict]:
    """``rows`` with a ``Normalised`` line after each (table, model, method) row: 100 x its mean over its benchmarks
    (``Avg.`` left out unless it is the only one) / the mean over the same benchmarks of the ``reference`` row of
    the same model (same table first, else the first table holding them all), the paper's and ours apart; None where
    a cell is missing or the reference has no such row."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["table"], r["model"], r["method"]), []).append(r)
    out = []
    for (table, model, method), group in groups.items():
        out += group
        if table in COST_TABLES or method == PRINTED_NORMALISED:  # a cost, or the paper's own ratios
            continue
        cells = {r["benchmark"]: r for r in group}
        benchmarks = [b for b in cells if b != AVERAGE] or [AVERAGE]
        refs = sorted((g for (t, m, row), g in groups.items() if m == model and row == reference
                       and t not in COST_TABLES),
                      key=lambda g: g[0]["table"] != table)
        ref = next(({r["benchmark"]: r for r in g} for g in refs if set(benchmarks) <= {r["benchmark"] for r in g}),
                   None)
        used = [cells[b] for b in benchmarks] + ([ref[b] for b in benchmarks] if ref is not None else [])
        ratio = {}
        for side in ("paper", "ours"):
            num = _mean([cells[b][side] for b in benchmarks])
            den = _mean([ref[b][side] for b in benchmarks]) if ref is not None else None
            ratio[side] = 100.0 * num / den if num is not None and den else None
        limits = [r["limit"] for r in used if r["limit"] is not None and r["ours"] is not None]
        out.append({
            "table": table, "model": model, "method": method, "train": "", "benchmark": NORMALISED,
            "metric": f"% of {reference}", "paper": ratio["paper"], "ours": ratio["ours"],
            "diff": ratio["ours"] - ratio["paper"] if None not in ratio.values() else None,
            "limit": limits[0] if limits else None, "partial": any(r["partial"] for r in used), "run": None,
            "note": "", "flag": "",
        })
    return out


# ----------------------------------------------------------------------------------------------------
# Output


def _fmt(value, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def to_markdown(rows: list[dict], unmatched: list[Ours]) -> str:
    """One markdown table per paper table, then our cells that match no paper cell."""
    lines: list[str] = []
    header = ["model", "method", "train", "benchmark", "metric", "paper", "ours", "diff"]
    limited = partial = refused = False
    constructed: set[str] = set()
    for table in dict.fromkeys(r["table"] for r in rows):
        lines += [f"### {table}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        flags = []
        for r in (r for r in rows if r["table"] == table):
            mark = "*" if r["limit"] is not None and r["ours"] is not None else ""
            limited |= bool(mark)
            if r["partial"]:
                mark, partial = mark + "+", True
            if str(r.get("note") or "").startswith(NOT_REPRODUCIBLE):
                mark, constructed = mark + "\u00a7", constructed | {r["note"]}
            elif r.get("note"):
                mark, refused = mark + "\u2020", True
            flag = "!" if r.get("flag") else ""
            if flag:
                flags.append(f"- ! {r['model']} / {r['method']} / {r['benchmark']}: {r['flag']}")
            cells = [r["model"], r["method"], r["train"], r["benchmark"], r["metric"], _fmt(r["paper"]) + flag,
                     _fmt(r["ours"]) + mark, _fmt(r["diff"], signed=True)]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", *flags, ""] if flags else [""]
    if limited:
        lines += ["\\* ours on the first eval.limit rows of each set only", ""]
    if partial:
        lines += ["\\+ our average over the sets with a result only (others skipped or unavailable)", ""]
    if refused:
        lines += [("\u2020 not compared: the paper's Avg. is a mean of lm-eval hub tasks, ours of other tasks "
                   "(moe-lab's llm_adapters_* tasks or eval sets); evaluate the paper's hub tasks (hub_tasks=true)"), ""]
    lines += [f"\u00a7 {note}" for note in sorted(constructed)] + ([""] if constructed else [])
    if any(r["benchmark"] == NORMALISED for r in rows):
        lines += [(f"{NORMALISED}: 100 x the row's mean over its benchmarks / the reference row's mean over the "
                   "same benchmarks (same model), paper and ours apart; n/a where a cell of either is missing"), ""]
    if not rows:
        lines += ["(no paper table has a result among the given runs)", ""]
    if unmatched:
        lines += ["### ours without a paper cell", "", "| model | method | train | benchmark | ours | run |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {c.model} | {c.method} | {c.train if c.train is not None else '?'} | {c.benchmark} | "
                  f"{_fmt(c.value)} | {c.run} |" for c in unmatched]
        lines.append("")
    return "\n".join(lines)


def write_outputs(out: Path, rows: list[dict], markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "comparison.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=OUT_FIELDS)
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
    (out / "comparison.md").write_text(markdown, encoding="utf-8")


def _alias(text: str) -> tuple[str, str]:
    ours, sep, paper = text.partition("=")
    if not sep or not ours or not paper:
        raise argparse.ArgumentTypeError(f"--as {text!r}: write OURS=PAPER, e.g. --as tiny_olmoe=olmoe_0125")
    return ours, paper


# ----------------------------------------------------------------------------------------------------
# Paper cells that no faithful run can reproduce, by construction (a note per cell; collect prints them with §)

NOT_REPRODUCIBLE = "not reproducible by construction: "
# [P2] Tables 10-12 / compression spec 2.13: at K = k the paper's SF, PP, PS and CP rows differ between AB / OC and
# RR, although its text says grouping is irrelevant at K = k (every group a singleton); ACP, DO-CP and DO-ACP agree
K_EQUALS_K_DIFFERS = {"scores": ("sf", "pp", "ps", "cp"), "groupings": ("ab", "oc")}


def _model_top_k(model: str) -> int | None:
    """``num_experts_per_tok`` of ``conf/model/<model>.yaml`` (its typed-in ``architecture``), None if unknown."""
    path = PAPERS_DIR.parent / "conf" / "model" / f"{model}.yaml"
    if not path.is_file():
        return None
    arch = OmegaConf.load(path).get("architecture") or {}
    k = arch.get("num_experts_per_tok")
    return None if k is None else int(k)


def moe_to_dense_construction_note(cell: dict) -> str | None:
    """MoE -> dense [P2]: a K = k cell of an AB / OC grouping with an SF / PP / PS / CP score. moe-lab follows the
    paper's text (K = k: singleton groups, the grouping is irrelevant, the student is the RR one), while the
    paper's tables give these cells other numbers (Table 3's "MC-SMoE metrics" SF x AB K = 8: pre-distill PPL
    11,668; the same student is SF x RR, 21,074)."""
    knobs = dict(part.split("=", 1) for part in cell.get("eval", "").split(";") if "=" in part)
    if knobs.get("score") not in K_EQUALS_K_DIFFERS["scores"] or knobs.get("grouping") not in \
            K_EQUALS_K_DIFFERS["groupings"] or "K" not in knobs:
        return None
    k = _model_top_k(cell["model"])
    if k is None or int(knobs["K"]) != k:
        return None
    return (f"{NOT_REPRODUCIBLE}K = k = {k}: every group is one expert, so the paper's text makes "
            f"{knobs['grouping'].upper()} the RR student, yet its tables give this cell another value")


CONSTRUCTION_NOTES = {"moe_to_dense": moe_to_dense_construction_note}


def flag_not_reproducible(paper: str, rows: list[dict], reported: list[dict]) -> list[dict]:
    """``rows`` with the ``CONSTRUCTION_NOTES`` of ``paper`` in their ``note`` (the difference withheld: it would
    measure the paper's construction, not ours)."""
    rule = CONSTRUCTION_NOTES.get(paper)
    if rule is None:
        return rows
    notes = {(c["table"], c["paper_model"], c["paper_row"]): rule(c) for c in reported}
    out = []
    for row in rows:
        note = notes.get((row["table"], row["model"], row["method"]))
        out.append({**row, "note": note, "diff": None} if note else row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.collect", description=__doc__.split("\n")[0])
    parser.add_argument("paper", help=f"one of: {', '.join(papers())}")
    parser.add_argument("results", nargs="+", help="task=evaluate run directories or sweep directories")
    parser.add_argument("--out", default=None, help="write comparison.csv and comparison.md into this directory")
    parser.add_argument("--as", dest="aliases", type=_alias, action="append", default=[], metavar="OURS=PAPER",
                        help="rename one of our model / method / train labels before matching (repeatable)")
    parser.add_argument("--all", action="store_true", help="also list the paper rows with none of our results")
    parser.add_argument("--reported", default=None, help="a reported.csv to use instead of the paper's (e.g. a "
                        "copy with the paper's numbers filled in)")
    args = parser.parse_args(argv)
    try:
        reported = load_reported(args.paper, args.reported)
        ours = load_ours(eval_runs(args.results), dict(args.aliases))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows, unmatched = compare(reported, ours, all_tables=args.all, hub_average=args.paper in HUB_AVERAGES,
                              normalise_to=NORMALISE.get(args.paper))
    rows = flag_not_reproducible(args.paper, rows, reported)
    markdown = to_markdown(rows, unmatched)
    if args.out:
        write_outputs(Path(args.out), rows, markdown)
    print(markdown, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
