"""No docstring, comment or doc page points outside the repository: every path to a Markdown page it names exists
in the repository (from the repository root or from the naming file's folder), a page of docs/ is never named
without its folder outside docs/, and nothing names a file beside the checkout."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import ROOT

TEXT = (".py", ".yaml", ".yml", ".md", ".sh", ".toml", ".cfg")
#: ``<dir>/<page>.md`` or ``../<page>.md`` (a path; an artefact written under a run directory is ``<...>/name.md``)
PATH = re.compile(r"(?<![\w./<>-])((?:\.\./)*(?:[\w-]+/)+[\w.-]+\.md)\b")
BARE = re.compile(r"(?<![\w./\"'-])([\w-]+\.md)\b")  # a quoted name is a path piece in code
BESIDE = "../" + "shared"  # spelt in two pieces: tests/test_fresh_clone.py refuses the whole name in any file
OUTSIDE = re.compile(re.escape(BESIDE) + r"|/work/|DESIGN\.md|\.\./\.\./")
SELF = "tests/test_repository_pointers.py"  # names bad pointers on purpose, to test the checks


def tracked() -> list[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    # mkdocs.yml's nav is relative to docs/ (mkdocs --strict checks it)
    return [f for f in files if f.endswith(TEXT) and (ROOT / f).is_file() and f not in ("mkdocs.yml", SELF)]


def dangling(name: str, text: str) -> list[str]:
    """The Markdown paths ``text`` (the content of tracked file ``name``) names that are not in the repository."""
    here = (ROOT / name).parent
    return [ref for ref in PATH.findall(text) if not (ROOT / ref).is_file() and not (here / ref).is_file()
            and not ref.startswith(("reference/", "docs/reference/"))]  # the API pages mkdocs generates


def test_every_markdown_path_named_exists():
    found = {name: dangling(name, (ROOT / name).read_text(encoding="utf-8")) for name in tracked()}
    assert not {name: refs for name, refs in found.items() if refs}


def test_a_docs_page_is_named_with_its_folder_outside_docs():
    pages = {p.name for p in (ROOT / "docs").rglob("*.md")} - {"README.md", "index.md"}
    outputs = {"summary.md", "results.md"}  # also files a run writes, named as such
    bare = {}
    for name in tracked():
        if name.startswith("docs/"):
            continue
        named = set(BARE.findall((ROOT / name).read_text(encoding="utf-8"))) & (pages - outputs)
        if named:
            bare[name] = sorted(named)
    assert not bare


def test_nothing_names_a_file_beside_the_checkout():
    assert not {name for name in tracked() if OUTSIDE.search((ROOT / name).read_text(encoding="utf-8"))}


def test_the_checks_see_what_they_look_for():
    assert dangling("moe_lab/x.py", "see docs/specs/compression.md and docs/nowhere.md, <run dir>/summary.md") == [
        "docs/nowhere.md"]
    assert dangling("experiments/esft/README.md", "Steps 2 and 3: `../README.md`") == []
    assert BARE.findall("(spec compression.md 2.11), docs/specs/finetuning.md") == ["compression.md"]
    assert OUTSIDE.search(f"the papers in {BESIDE}/papers") and SELF not in tracked()
