"""The shipped ``experiments/<paper>/reported.csv``: every filled value is a number the paper (fine-tuning papers,
their plain text in ``$MOE_LAB_PAPERS_DIR``; the repository does not carry them) or the compression spec
(docs/specs/compression.md) prints; every cell names its source; the flags on printed Avg. cells are
recomputed here from their rows (set exactly where the printed Avg. is off its row's mean by more than rounding),
and every other flag is checked against the text or its partner cell.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

import pytest

from experiments import collect
from tests.conftest import ROOT

# the papers' plain text (expert_condenser.txt, densemixer.txt, ...) is not in the repository: the checks against it
# run where $MOE_LAB_PAPERS_DIR names a folder holding it, and skip (saying so) elsewhere
PAPERS_DIR = Path(os.environ.get("MOE_LAB_PAPERS_DIR", "")).expanduser() if os.environ.get("MOE_LAB_PAPERS_DIR") \
    else None
# fine-tuning paper -> its text file in PAPERS_DIR (ESFT's own paper is not there: its cells have no source)
FINETUNING_PAPERS = {"compressed_experts": "compressed_experts.txt", "condenser": "expert_condenser.txt",
                     "densemixer": "densemixer.txt", "esft": None}
COMPRESSION_PAPERS = ["condense", "moe_to_dense"]
AVG_SLIP = "is not the mean of the row's"


def printed_numbers(text: str) -> set[float]:
    """Every number written in ``text`` (thousands separators dropped; a sign or a count suffix is not part of it)."""
    return {float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", text.replace(",", ""))}


def not_in_text(rows: list[dict], text: str) -> list[dict]:
    """The rows whose value is not a number printed in ``text``."""
    numbers = printed_numbers(text)
    return [row for row in rows if row["value"] is not None and row["value"] not in numbers]


def _raw(paper: str) -> list[dict]:
    """reported.csv as written (values as printed strings: their decimals give the rounding)."""
    with open(collect.PAPERS_DIR / paper / "reported.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def paper_text(paper: str) -> str:
    """The paper's plain text from ``$MOE_LAB_PAPERS_DIR``; skips the test (naming the variable) without it."""
    name = FINETUNING_PAPERS[paper]
    if name is None:
        return ""
    if PAPERS_DIR is None or not (PAPERS_DIR / name).is_file():
        where = "MOE_LAB_PAPERS_DIR is not set" if PAPERS_DIR is None else f"{PAPERS_DIR / name} does not exist"
        pytest.skip(f"the papers' text is not in the repository ({where}): set MOE_LAB_PAPERS_DIR to the folder "
                    f"holding {name} to check reported.csv against it")
    return (PAPERS_DIR / name).read_text(encoding="utf-8")


def test_every_paper_has_a_reported_csv():
    assert collect.papers() == sorted([*FINETUNING_PAPERS, *COMPRESSION_PAPERS])


def test_compression_values_are_written_in_the_spec():
    spec = (ROOT / "docs" / "specs" / "compression.md").read_text()
    for paper in COMPRESSION_PAPERS:
        rows = collect.load_reported(paper)
        assert rows and all("compression spec" in row["source"] for row in rows), paper
        missing = not_in_text(rows, spec)
        assert not missing, (paper, missing[:3])


@pytest.mark.parametrize("paper", sorted(FINETUNING_PAPERS))
def test_finetuning_values_are_printed_in_the_paper_and_name_their_source(paper):
    rows = collect.load_reported(paper)
    assert rows
    for row in rows:
        if row["value"] is None:
            assert row["source"].startswith("no source: "), row
        else:  # "paper Table N, row R, column C"
            assert re.match(r"paper Table \d+, row .+, column .+", row["source"]), row
    if FINETUNING_PAPERS[paper] is None:
        assert all(row["value"] is None for row in rows)
        return
    filled = sum(row["value"] is not None for row in rows)
    assert filled >= 0.9 * len(rows), (paper, filled, len(rows))  # the gaps are the few cells the paper lacks
    text = paper_text(paper)
    missing = not_in_text(rows, text)
    assert not missing, (paper, missing[:3])
    # each paper row's cells (in the paper's column order) are printed, in that order, on one line of its table
    lines = [[float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", line)] for line in text.splitlines()]
    for source, values in _paper_rows(rows).items():
        assert any(_in_order(values, line) for line in lines), (paper, source, values)


def _paper_rows(rows: list[dict]) -> dict[str, list[float]]:
    """source's "paper Table N, row R" (a parenthesised note dropped) -> the values of its cells, in file order."""
    out: dict[str, list[float]] = {}
    for row in rows:
        if row["value"] is not None:
            key = re.sub(r" \(.*\)$", "", row["source"].rsplit(", column", 1)[0])
            out.setdefault(key, []).append(row["value"])
    return out


def _in_order(values: list[float], line: list[float]) -> bool:
    numbers = iter(line)
    return all(any(v == n for n in numbers) for v in values)


def _decimals(value: str) -> int:
    return len(value.partition(".")[2])


@pytest.mark.parametrize("paper", sorted(FINETUNING_PAPERS))
def test_avg_flags_are_exactly_the_printed_averages_off_their_rows(paper):
    """Group each paper row (table, model, row label, eval settings); recompute its mean over the filled cells;
    the printed Avg. is a slip when it is off by more than the printed rounding allows: every value is rounded to
    its last printed decimal (d), so the mean of rounded values and the rounded Avg. differ by at most 10^-d."""
    groups: dict[tuple, list[dict]] = {}
    for row in _raw(paper):
        groups.setdefault((row["table"], row["paper_model"], row["paper_row"], row["eval"]), []).append(row)
    checked = slips = 0
    for key, cells in groups.items():
        if key[2] == collect.PRINTED_NORMALISED:  # its Avg. is the ratio of the Avgs (test_printed_normalised_...)
            continue
        avg = [c for c in cells if c["benchmark"] == collect.AVERAGE and c["value"]]
        sets = [c for c in cells if c["benchmark"] != collect.AVERAGE and c["value"]]
        for c in sets:
            assert AVG_SLIP not in c["flag"], (key, c)
        if not avg:
            continue
        assert len(avg) == 1 and sets, key
        mean = sum(float(c["value"]) for c in sets) / len(sets)
        tolerance = 10.0 ** -max(_decimals(c["value"]) for c in [*sets, *avg]) + 1e-9
        slip = abs(mean - float(avg[0]["value"])) > tolerance
        assert (AVG_SLIP in avg[0]["flag"]) == slip, (key, avg[0]["value"], mean)
        checked, slips = checked + 1, slips + slip
    assert checked or FINETUNING_PAPERS[paper] is None  # every table the papers average (ESFT: no source)


def test_printed_normalised_cells_are_the_ratio_of_their_rows():
    """Compressed Experts' Norm. Perf. (%) lines (Tables 3-6): each printed cell is 100 x the w/ CE cell / the Top-k
    SFT cell of its column (Avg.: of the printed Avgs), recomputed here from reported.csv's own cells to the
    printed decimal (the cells themselves are checked against the paper's text above)."""
    rows = _raw("compressed_experts")
    cells = {(r["table"], r["paper_model"], r["paper_row"], r["train"], r["benchmark"]): float(r["value"])
             for r in rows if r["value"]}
    printed = [r for r in rows if r["paper_row"] == collect.PRINTED_NORMALISED]
    assert len(printed) == 16 and all(r["metric"] == f"% of {collect.NORMALISE['compressed_experts']}" for r in printed)
    for r in printed:
        key = (r["table"], r["paper_model"])
        ce = cells[(*key, "Compressed Experts", r["train"], r["benchmark"])]
        full = cells[(*key, "Top-k SFT", r["train"], r["benchmark"])]
        assert abs(100 * ce / full - float(r["value"])) <= 0.05 + 1e-9, (r["source"], 100 * ce / full)


def test_cost_cells_are_the_papers_timing_tables():
    """The timing / latency / FLOP cells: Compressed Experts Tables 3/4 latency, Expert Condenser Table 4, DenseMixer
    Tables 5/6; one table each, never normalised or averaged (values and their lines: checked above)."""
    counts = {}
    for paper in ("compressed_experts", "condenser", "densemixer"):
        for r in _raw(paper):
            if r["table"] in collect.COST_TABLES:
                counts[(paper, r["source"].split(",")[0])] = counts.get((paper, r["source"].split(",")[0]), 0) + 1
                assert r["benchmark"] != collect.AVERAGE and r["value"], r
    assert counts == {("compressed_experts", "paper Table 3"): 3, ("compressed_experts", "paper Table 4"): 3,
                      ("condenser", "paper Table 4"): 9, ("densemixer", "paper Table 5"): 6,
                      ("densemixer", "paper Table 6"): 18}


def test_known_slips_are_flagged():
    """The slips the issue names, and the counts the papers' tables give (recomputed above)."""
    condenser = {(r["table"], r["paper_model"], r["paper_row"], r["benchmark"]): r for r in _raw("condenser")}
    gamma = condenser[("Gamma sweep", "Qwen1.5-MoE-A2.7B", "G-5e-5", collect.AVERAGE)]
    assert gamma["value"] == "61.6" and AVG_SLIP in gamma["flag"] and "(59.60)" in gamma["flag"]
    for bench, other in (("SVAMP", "MultiArith 56.4"), ("MultiArith", "SVAMP 92.0")):
        assert f"swapped with {other}" in condenser[("Math7K", "OLMoE-1B-7B-0125", "DenseMixer", bench)]["flag"]
    # Table 5 (pruning after condensing): ESFT Small Dense 32's Avg. 31.6, its row's mean 31.04
    pruned = condenser[("Pruning after condensing", "DeepSeek-V2-Lite", "ESFT, Small Dense n'=k'=32", collect.AVERAGE)]
    assert pruned["value"] == "31.6" and "(31.04)" in pruned["flag"]


@pytest.mark.parametrize("paper", sorted(FINETUNING_PAPERS))
def test_other_flags_are_checked(paper):
    """A 'likely swapped with <set> <value>' flag names a cell of the same row holding that value and flagged back;
    a 'printed <text>' flag quotes the paper's text."""
    rows = _raw(paper)
    printed_texts = []  # checked against the paper's text after the swaps (which need no paper)
    index = {(r["table"], r["paper_model"], r["paper_row"], r["eval"], r["benchmark"]): r for r in rows}
    for row in rows:
        for part in filter(None, (p.strip() for p in row["flag"].split(";"))):
            if AVG_SLIP in part or part.startswith("it is the mean of") or part == "entered as printed":
                continue
            swap = re.match(r"likely swapped with (\S+) ([\d.]+)", part)
            printed = re.match(r"printed (-?[\d.]+)", part)
            assert swap or printed, (paper, row["benchmark"], part)
            if swap:
                other = index[(row["table"], row["paper_model"], row["paper_row"], row["eval"], swap[1])]
                assert other["value"] == swap[2] and f"swapped with {row['benchmark']} {row['value']}" in other["flag"]
            else:
                printed_texts.append(printed[1])
    if printed_texts:
        text = paper_text(paper)
        assert all(t in text for t in printed_texts), (paper, [t for t in printed_texts if t not in text])


def test_tiny_grid_prints_the_papers_numbers_and_flags(tmp_path, capsys):
    """The tiny grid's labels renamed as its README says (--as tiny_olmoe=olmoe_0125 --as math_data=math7k): the
    shipped Table 2 numbers beside ours, ours - paper per cell, and the swapped DenseMixer cells marked and listed."""
    from tests.test_experiments import _eval_run, _finetune_run

    for n, method in enumerate(("condenser", "densemixer")):
        ft = _finetune_run(tmp_path / "ft", f"{n}_{method}", "math_data")
        _eval_run(tmp_path / "ev" / f"{n}_{method}", "tiny_olmoe", method, {"GSM8K": 10.0, "SVAMP": 20.0}, ft / "export")
    (tmp_path / "ev" / "multirun.yaml").write_text("task:\n  name: evaluate\n")
    argv = ["condenser", str(tmp_path / "ev"), "--as", "tiny_olmoe=olmoe_0125", "--as", "math_data=math7k"]
    assert collect.main(argv) == 0
    out = capsys.readouterr().out
    lines = {tuple(c.strip() for c in line.strip("|").split("|")[:4]): [c.strip() for c in line.split("|")[6:9]]
             for line in out.splitlines() if line.startswith("| OLMoE")}
    assert lines[("OLMoE-1B-7B-0125", "Expert Condenser", "math7k", "GSM8K")] == ["68.40", "10.00", "-58.40"]
    assert lines[("OLMoE-1B-7B-0125", "DenseMixer", "math7k", "SVAMP")] == ["92.00!", "20.00", "-72.00"]
    assert not any(key[1] == "Base Model" for key in lines)  # rows without a result of ours: with --all only
    assert "- ! OLMoE-1B-7B-0125 / DenseMixer / SVAMP: likely swapped with MultiArith 56.4" in out
