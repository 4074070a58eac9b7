"""moe_lab's import graph, read from its own sources (every ``import`` / ``from ... import`` of every module,
those inside functions included): it has no cycles, module by module and package by package; every import looks
down the floors of :data:`FLOORS` (docs/design.md draws them); and no task module imports another task
module (tasks/ holds only what run.py dispatches, each task composed of runs and library calls)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "moe_lab"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: {moe_lab modules it imports}}`` for every module of the package at ``root``. ``from p import
    x`` counts as importing ``p.x`` where that is a module, else ``p``; an import of a package's module does not
    count as importing the package's ``__init__`` (Python runs it first, but it is no edge of the code's own)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {known(a.name) for a in node.names if a.name.split(".")[0] == top}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != top:
                    continue
                edges |= {f"{source}.{a.name}" if f"{source}.{a.name}" in files else known(source)
                          for a in node.names}
        graph[name] = edges - {None, name}
    return graph


#: moe_lab's floors, bottom first: each top-level package or module of moe_lab (``moe_lab`` itself: the package's
#: face) imports only its own floor and the floors before it
FLOORS: tuple[tuple[str, frozenset[str]], ...] = (
    ("ground floor: leaf helpers and the task table", frozenset({"core"})),
    ("the MoE layer and data", frozenset({"moe", "data"})),
    ("models and checkpoint converters", frozenset({"models", "convert"})),
    ("compression algorithms", frozenset({"compress"})),
    ("analysis: statistics, estimates, plots", frozenset({"analysis"})),
    ("run machinery: lock, checkpoints, resume, signals, strategies, trainer", frozenset({"runtime"})),
    ("distillation losses and teachers", frozenset({"distill"})),
    ("callbacks", frozenset({"callbacks"})),
    ("methods: installers and LightningModules", frozenset({"methods"})),
    ("evaluation", frozenset({"eval"})),
    ("runs: training, plan, stages and the runs behind task=X", frozenset({"runs", "sweep_summary"})),
    ("tasks", frozenset({"tasks"})),
    ("the package's face and the support matrix", frozenset({"moe_lab", "families"})),
)


def top_level(module: str) -> str:
    """The top-level package or module of moe_lab that ``module`` belongs to (``moe_lab`` for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with each top-level package or module of moe_lab one node (an import of the root
    package's ``__init__`` by a submodule is no edge: Python runs it first, whatever the code imports)."""
    packages: dict[str, set[str]] = {}
    for module, edges in graph.items():
        packages.setdefault(top_level(module), set()).update(
            top_level(e) for e in edges if top_level(e) != top_level(module) and e != "moe_lab")
    return packages


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_graph_reader_sees_relative_absolute_and_function_level_imports(tmp_path):
    pkg = tmp_path / "moe_lab"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\nimport os\n")
    (pkg / "sub" / "__init__.py").write_text("from .c import C\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "sub" / "c.py").write_text("import moe_lab.a.x\nfrom moe_lab.sub import b\n")
    graph = import_graph(pkg)
    assert graph == {"moe_lab": set(), "moe_lab.a": {"moe_lab.sub.b"}, "moe_lab.sub": {"moe_lab.sub.c"},
                     "moe_lab.sub.b": {"moe_lab.a"}, "moe_lab.sub.c": {"moe_lab.a", "moe_lab.sub.b"}}
    assert cycles(graph) == [["moe_lab.a", "moe_lab.sub.b"]]
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_moe_lab_has_no_import_cycles(graph):
    assert len(graph) > 100  # the whole package was read
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_packages_form_no_cycle(graph):
    packages = package_graph(graph)
    assert {"core", "moe", "methods", "runs", "runtime", "tasks"} <= set(packages)
    assert not cycles(packages), "package-level import cycles: " + "; ".join(" <-> ".join(c) for c in cycles(packages))


def test_every_import_looks_down_the_floors(graph):
    floor = {package: i for i, (_, members) in enumerate(FLOORS) for package in members}
    packages = package_graph(graph)
    assert set(packages) == set(floor), "every top-level package or module of moe_lab has a floor in FLOORS"
    upward = sorted((m, e) for m, edges in graph.items() for e in edges
                    if e != "moe_lab" and floor[top_level(e)] > floor[top_level(m)])
    assert not upward, "imports that climb the floors: " + "; ".join(f"{m} -> {e}" for m, e in upward)


def test_the_floor_check_sees_an_upward_import():
    graph = {"moe_lab.core.atomic": {"moe_lab.runs.plan"}, "moe_lab.runs.plan": {"moe_lab.core.atomic"}}
    floor = {package: i for i, (_, members) in enumerate(FLOORS) for package in members}
    assert [(m, e) for m, es in graph.items() for e in es if floor[top_level(e)] > floor[top_level(m)]] == [
        ("moe_lab.core.atomic", "moe_lab.runs.plan")]
    assert package_graph(graph) == {"core": {"runs"}, "runs": {"core"}}
    assert cycles(package_graph(graph)) == [["core", "runs"]]


def test_the_ground_floor_imports_nothing_above_it(graph):
    """moe_lab.core (atomic writes, precision, plain config values, export manifests) is the ground floor: it imports
    no other part of moe_lab, which every other floor may import; the MoE layer (moe_lab.moe) reaches no run
    machinery (moe_lab.runtime) for its writes."""
    core = {m for m in graph if m.startswith("moe_lab.core")}
    assert {"moe_lab.core.atomic", "moe_lab.core.precision", "moe_lab.core.plain", "moe_lab.core.export_check"} <= core
    above = {m: sorted(e for e in graph[m] if not e.startswith("moe_lab.core")) for m in sorted(core)}
    assert not {m: e for m, e in above.items() if e}, "the ground floor imports upward"
    moe_to_runtime = {(m, e) for m in graph if m.startswith("moe_lab.moe") for e in graph[m]
                      if e.startswith("moe_lab.runtime")}
    assert not moe_to_runtime


def test_no_task_imports_another_task(graph):
    tasks = {m for m in graph if m.startswith("moe_lab.tasks.")}
    assert {"moe_lab.tasks.moe_to_dense", "moe_lab.tasks.condenser_two_phase", "moe_lab.tasks.cd_moe_sft"} <= tasks
    crossing = {m: sorted(graph[m] & (tasks | {"moe_lab.tasks"})) for m in sorted(tasks)}
    assert not {m: t for m, t in crossing.items() if t}, "task modules importing task modules"


def test_tasks_holds_only_what_run_py_dispatches(graph):
    """Every module of tasks/ is the run of a task table row; every row's run is a function of tasks/ or runs/."""
    from moe_lab.tasks import TASKS

    modules = {m for m in graph if m.startswith("moe_lab.tasks.")}
    runs = {task.run.partition(":")[0] for task in TASKS.values()}
    assert modules <= runs
    assert all(r.startswith(("moe_lab.tasks.", "moe_lab.runs.")) for r in runs)
    assert all(callable(task.function()) for task in TASKS.values())


def test_the_method_registry_imports_no_method_and_is_filled_on_import():
    import subprocess
    import sys

    assert not {m for m in import_graph()["moe_lab.methods.registry"] if m.startswith("moe_lab.methods.")}
    code = ("from moe_lab.methods.registry import ADAPTERS, EXPORT_LOADERS, METHODS; "
            "print((sorted(METHODS), sorted(ADAPTERS), sorted(EXPORT_LOADERS)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    methods = ["compressed_experts", "condenser", "densemixer", "esft", "frozen_router", "sft"]
    assert out.stdout.strip() == str((methods, ["lora"], ["condenser.json", "moe_lab_compressed_experts.json"]))
