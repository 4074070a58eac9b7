"""The built documentation site as a reader sees it: every page rendered by a real headless Chromium at 1400 CSS px
(tests/headless_chromium.py). The text of the pages' ``<...>`` code and math survives (Markdown reads a bare
``<dL/dy, E_e(x)>`` as an HTML tag and the browser drops it), the support matrix's 12 columns are all in view, its
cells read as the generator wrote them, and no code line or table cell is cut off at the edge of its box.

Needs a Chromium on PATH (Debian: ``apt-get install -y chromium``); skipped, saying so, without one."""

from __future__ import annotations

import html
import re

import pytest

from moe_lab import families
from tests.conftest import ROOT
from tests.headless_chromium import Chromium, chromium_binary
from tests.test_docs_site import _page_html, build_site
from tests.test_readme_commands import _site_pages

needs_chromium = pytest.mark.skipif(chromium_binary() is None,
                                    reason="no Chromium on PATH: install it (Debian: apt-get install -y chromium)")

WIDTH = 1400
PAGES = [p.relative_to(ROOT / "docs").as_posix() for p in _site_pages()]
FRONT_MATTER = re.compile(r"\A---\n.*?\n---\n", re.DOTALL)
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
FENCE = re.compile(r"^( *)(```+|~~~+)[^\n]*\n(.*?)^\1\2[ \t]*$", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.DOTALL)
# a tag-like <...> in prose: not "<= 1.3", not an autolink
ANGLED = re.compile(r"<(?![\s=/!]|https?:|mailto:)[^<>\n]{1,100}>")


def _squash(text: str) -> str:
    return " ".join(text.split())


def angled_texts(markdown: str) -> list[str]:
    """What of a page's Markdown holds ``<...>`` and must be readable on the page: each such code-block line, each
    such inline code span, and each ``<...>`` of the prose (its HTML entities decoded: ``&lt;a>`` reads ``<a>``)."""
    text = COMMENT.sub("", FRONT_MATTER.sub("", markdown))
    found = []

    def fence(match):
        found.extend(_squash(line) for line in match.group(3).splitlines() if "<" in line)
        return "\n"

    def span(match):
        if "<" in match.group(2):
            found.append(_squash(match.group(2)))
        return " "

    prose = CODE_SPAN.sub(span, FENCE.sub(fence, text))
    found += [_squash(m) for m in ANGLED.findall(html.unescape(prose))]
    return list(dict.fromkeys(found))


def test_angled_texts_finds_code_lines_spans_and_prose():
    page = ("---\nhide: [toc]\n---\n<!-- families:begin -->\nA `x=<run>/export` and dL/dw_e = <dL/dy, E_e(x)>, "
            "target <= 1.05, <https://a.b>, | &lt;llama4 checkpoint> |\n\n```bash\npython run.py a=<b>\nplain\n```\n")
    assert angled_texts(page) == ["python run.py a=<b>", "x=<run>/export", "<dL/dy, E_e(x)>",
                                  "<llama4 checkpoint>"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return build_site(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def browser():
    with Chromium() as chromium:
        yield chromium


def _open(browser, site, page: str):
    return browser.open(_page_html(site, page).as_uri(), WIDTH)


@pytest.mark.slow
@needs_chromium
def test_code_and_math_text_survive_on_every_page(site, browser):
    lost = {}
    checked = 0
    for page in PAGES:
        wanted = angled_texts((ROOT / "docs" / page).read_text(encoding="utf-8"))
        if not wanted:
            continue
        tab = _open(browser, site, page)
        shown = _squash(tab.evaluate("document.querySelector('article').innerText"))
        tab.close()
        checked += len(wanted)
        if missing := [text for text in wanted if text not in shown]:
            lost[page] = missing
    assert checked > 50
    assert not lost, f"text of the Markdown missing from the rendered pages: {lost}"


MATRIX_JS = """(() => {
  const table = [...document.querySelectorAll('article table')]
      .find(t => t.querySelector('th') && t.querySelector('th').innerText.trim() === 'family');
  const wrap = table.closest('.md-typeset__scrollwrap');
  window.scrollTo(0, table.getBoundingClientRect().top + window.scrollY - 200);  // below the sticky header bar
  const box = wrap.getBoundingClientRect();
  const headers = [...table.querySelectorAll('th')].map(th => {
    const r = th.getBoundingClientRect();
    const hit = document.elementFromPoint((r.left + r.right) / 2, (r.top + r.bottom) / 2);
    return {text: th.innerText.trim(), left: r.left, right: r.right, seen: hit !== null && th.contains(hit)};
  });
  const rows = [...table.querySelectorAll('tbody tr')].map(tr => [...tr.cells].map(td => td.innerText));
  return {headers, rows, box_left: box.left, box_right: box.right, viewport: document.documentElement.clientWidth,
          sideways: wrap.scrollWidth - wrap.clientWidth};
})()"""


@pytest.mark.slow
@needs_chromium
def test_support_matrix_shows_all_12_columns_at_1400px(site, browser, tmp_path):
    tab = _open(browser, site, "families.md")
    matrix = tab.evaluate(MATRIX_JS)
    shot = tab.screenshot(tmp_path / "families.png", full_page=False)
    tab.close()
    headers = matrix["headers"]
    assert [h["text"] for h in headers] == ["family", *families.COLUMNS]
    left, right = max(0, matrix["box_left"] - 1), min(matrix["viewport"], matrix["box_right"] + 1)
    hidden = [h["text"] for h in headers if not (h["seen"] and left <= h["left"] and h["right"] <= right)]
    assert not hidden, f"support-matrix columns out of view at {WIDTH} px: {hidden} (screenshot: {shot})"
    assert matrix["sideways"] <= 1, f"the support matrix scrolls sideways by {matrix['sideways']} px ({shot})"
    # every cell reads as the generator's text (escaping and Markdown leave it whole)
    rows = {cells[0].strip(): [_squash(c) for c in cells[1:]] for cells in matrix["rows"]}
    for model_type in ("llama4_text", "phimoe", "gpt_oss", "olmoe"):
        row = families.matrix_row(model_type)
        assert rows[model_type] == [_squash(row[c]) for c in families.COLUMNS], model_type


CUT_JS = """(() => {
  const cut = [];
  const outside = (node, box) => {
    const range = document.createRange();
    range.selectNodeContents(node);
    return [...range.getClientRects()].some(r => r.width > 0 && (r.right > box.right + 1 || r.left < box.left - 1));
  };
  for (const code of document.querySelectorAll('article pre > code')) {
    if (outside(code, code.closest('pre').getBoundingClientRect())) cut.push('code: ' + code.innerText.slice(0, 80));
  }
  for (const cell of document.querySelectorAll('article table th, article table td')) {
    const wrap = cell.closest('.md-typeset__scrollwrap') || cell.closest('table');
    if (outside(cell, wrap.getBoundingClientRect())) cut.push('table cell: ' + cell.innerText.slice(0, 80));
  }
  return cut;
})()"""


@pytest.mark.slow
@needs_chromium
def test_no_code_line_or_table_cell_is_cut_at_1400px(site, browser, tmp_path):
    cut = {}
    for page in PAGES:
        tab = _open(browser, site, page)
        if found := tab.evaluate(CUT_JS):
            cut[page] = found
            tab.screenshot(tmp_path / page.replace("/", "_").replace(".md", ".png"))
        tab.close()
    assert not cut, f"text cut off at the edge of its box at {WIDTH} px (screenshots in {tmp_path}): {cut}"


@pytest.mark.slow
@needs_chromium
def test_reproducing_page_shows_plan_true_at_1400px(site, browser):
    """The reported case: ``plan=true`` at the end of a long command line is on screen without scrolling."""
    tab = _open(browser, site, "reproducing.md")
    where = tab.evaluate("""(() => {
      const code = [...document.querySelectorAll('article pre > code')].find(c => c.innerText.includes('plan=true'));
      const nodes = [], walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);  // highlighting splits it
      for (let n; (n = walker.nextNode());) nodes.push(n);
      const starts = [];
      let text = '';
      for (const n of nodes) { starts.push(text.length); text += n.data; }
      const locate = offset => {
        const i = starts.findLastIndex(s => s <= offset);
        return [nodes[i], offset - starts[i]];
      };
      const at = text.indexOf('plan=true');
      const range = document.createRange();
      range.setStart(...locate(at));
      range.setEnd(...locate(at + 'plan=true'.length - 1));
      range.setEnd(range.endContainer, range.endOffset + 1);
      const r = range.getBoundingClientRect(), box = code.closest('pre').getBoundingClientRect();
      return {left: r.left, right: r.right, box_left: box.left, box_right: box.right,
              viewport: document.documentElement.clientWidth};
    })()""")
    tab.close()
    assert where["box_left"] <= where["left"] and where["right"] <= min(where["box_right"], where["viewport"]), where
