"""The documentation site: ``mkdocs build --strict`` passes (broken links, anchors and references fail it), the API
reference has a page for every module of the package, the README's links land, and what the pages name exists."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys

import pytest

import moe_lab
from tests.conftest import ROOT
from tests.test_readme_commands import DOCS, readme_commands

README_LINK = re.compile(r"\]\((docs/[^)#\s]+\.md)(?:#([^)\s]+))?\)")
DOTTED = re.compile(r"(?<![./\w])moe_lab(?:\.[A-Za-z_]\w*)+")  # not a file name (.moe_lab.lock)
MODULE_FILE = re.compile(r"\bmoe_lab(?:/\w+)+\.py\b")


def _page_html(site, page: str):
    """The built HTML of ``docs/<page>.md`` (use_directory_urls: ``<page>/index.html``; index.md: ``index.html``)."""
    stem = page.removesuffix(".md")
    return site / ("index.html" if stem == "index" else f"{stem}/index.html")


BANNER_SWITCHES = ("NO_MKDOCS_2_WARNING", "DISABLE_MKDOCS_2_WARNING")  # what silences the third-party banners


def build_site(out):
    """``mkdocs build --strict`` into ``out`` as a user runs it: the banners' off switches are removed from the
    environment, and every line printed must be one of mkdocs' own INFO lines (pyproject's dev extra keeps the
    plugins that print a banner of their own out)."""
    env = {k: v for k, v in os.environ.items() if k not in BANNER_SWITCHES}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-6000:]}"
    other = [line for line in log.splitlines() if line.strip() and not line.startswith("INFO ")]
    assert not other, "mkdocs build printed more than its INFO lines:\n" + "\n".join(other[:40])
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return build_site(tmp_path_factory.mktemp("site"))


@pytest.mark.slow
def test_every_page_is_built(site):
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert "families.md" in pages and "index.md" in pages
    missing = [p for p in pages if not _page_html(site, p).is_file()]
    assert not missing, missing


@pytest.mark.slow
def test_api_reference_has_a_page_for_every_module(site):
    """Found by importing the package tree (pkgutil), not by the generator's own file walk."""
    names = ["moe_lab"] + [m.name for m in pkgutil.walk_packages(moe_lab.__path__, "moe_lab.")
                           if not any(part.startswith("_") for part in m.name.split("."))]  # private: no page
    assert len(names) > 100
    missing = []
    for name in names:
        parts = name.split(".")
        folder = site / "reference" / os.path.join(*parts)
        if not (folder / "index.html").is_file():
            missing.append(name)
        elif name not in (folder / "index.html").read_text(encoding="utf-8"):
            missing.append(f"{name} (page without its name)")
    assert not missing, missing
    registry = (site / "reference" / "moe_lab" / "moe" / "registry" / "index.html").read_text(encoding="utf-8")
    assert "FamilySpec" in registry  # the docstrings are rendered, not only the headings


@pytest.mark.slow
def test_readme_links_land_on_built_pages_and_anchors(site):
    links = README_LINK.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    assert ("docs/families.md", "") in links  # the README points to the support matrix
    for path, anchor in links:
        page = _page_html(site, path.removeprefix("docs/"))
        assert page.is_file(), path
        if anchor:
            assert f'id="{anchor}"' in page.read_text(encoding="utf-8"), f"{path}#{anchor}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1).splitlines()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("python -m pytest")]
    command = "python -m pytest -q -n 2"  # README's; CI adds only report flags (slowest tests, skip reasons)
    assert len(ci) == 1 and ci[0].startswith(command) and command in block
    assert set(ci[0][len(command):].split()) <= {"--durations=15", "-rs"}, ci[0]


def test_commands_name_modules_and_scripts_that_exist():
    """A moved module or script fails here, naming the page command to update (runnable or not)."""
    stale = []
    for command in readme_commands():
        argv = re.sub(r"^(?:[A-Z_]+=\S+\s+)*python\s+", "", command).split()
        if argv[0] == "-m":
            if importlib.util.find_spec(argv[1]) is None:
                stale.append(command)
        elif argv[0].endswith(".py") and not (ROOT / argv[0]).is_file():
            stale.append(command)
    assert not stale, stale


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_names_in_the_docs_exist():
    """Every ``moe_lab.<...>`` name and ``moe_lab/<...>.py`` path the README and the pages show resolves."""
    text = "\n".join(doc.read_text(encoding="utf-8") for doc in DOCS)
    dotted = sorted({name.rstrip(".") for name in DOTTED.findall(text)})
    assert len(dotted) > 20
    assert not [name for name in dotted if not _resolves(name)]
    paths = sorted(set(MODULE_FILE.findall(text)))
    assert not [p for p in paths if not (ROOT / p).is_file()]
