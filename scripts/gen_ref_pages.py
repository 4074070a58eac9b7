"""Generate the API reference pages from the package tree (run by mkdocs-gen-files at ``mkdocs build``).

Every module of ``moe_lab`` that Python can import by its dotted name (a ``.py`` file inside a chain of packages)
gets one page, ``reference/<dotted path>.md`` holding a mkdocstrings ``::: <module>`` block; a package's page is
its ``index.md``. ``reference/SUMMARY.md`` is the navigation (mkdocs-literate-nav). Nothing lists modules by hand,
so moving a module moves its page.
"""

from __future__ import annotations

from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "moe_lab"


def modules(root: Path = ROOT, package: str = PACKAGE) -> list[tuple[str, ...]]:
    """Dotted-name parts of every importable module under ``package``, packages before their modules."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__main__" or any(p.startswith("_") and p != "__init__" for p in parts):
            continue
        folders = path.relative_to(root).parents
        if not all((root / folder / "__init__.py").is_file() for folder in list(folders)[:-1]):
            continue  # a data folder (e.g. lm-eval task files), not a package
        found.append(parts[:-1] if parts[-1] == "__init__" else parts)
    return sorted(found)


def main() -> None:
    nav = mkdocs_gen_files.Nav()
    for parts in modules():
        is_package = (ROOT / Path(*parts) / "__init__.py").is_file()
        doc = Path("reference", *parts, "index.md") if is_package else Path("reference", *parts).with_suffix(".md")
        nav[parts] = doc.relative_to("reference").as_posix()
        with mkdocs_gen_files.open(doc, "w") as out:
            out.write(f"::: {'.'.join(parts)}\n")
        mkdocs_gen_files.set_edit_path(doc, (Path(*parts) / "__init__.py" if is_package
                                             else Path(*parts).with_suffix(".py")).as_posix())
    with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as out:
        out.writelines(nav.build_literate_nav())


main()
