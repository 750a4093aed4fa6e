"""The package's import graph: the folder order (docs/architecture.md), no cycles (function-level imports counted),
every function-level import says why, and loading the plugin imports neither httpx nor prometheus_client nor starlette.

The graph is read from the source with ``ast``, so an import inside a function counts as much as one at the top:
a cycle that only closes at call time still ties the two modules together (neither can be understood, tested or
moved alone). Imports under ``if TYPE_CHECKING:`` are left out (they never run).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_pdserve.config import owned_flags, setting_table

PACKAGE = "pytest_pdserve"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

#: Cycles that another change removes, by the modules' own names (none left since the reuse split).
KNOWN_CYCLES: set[frozenset[str]] = set()
#: Files whose function-level imports another change rewrites (none left since the reuse split).
KNOWN_UNEXPLAINED: set[str] = set()
#: What loading the plugin (the pytest11 entry point) must not import: they load when a cluster is needed.
HEAVY = ("httpx", "prometheus_client", "starlette", "uvicorn", "torch", "vllm")

#: The folder order, bottom up (docs/architecture.md, "The folders are the layers"): a module imports only from its
#: own room (a folder of pytest_pdserve/, or a top-level module) and the rooms of its layer and the layers before it,
#: at module level or inside a function (``if TYPE_CHECKING:`` imports are left out: they never run). The rooms of
#: one layer may import each other; the ones with several rooms are knots still to untie (cluster.py drives
#: running/'s processes, spec.py and config/ share the owned-flags and presets tables, errors.py redacts with common/).
#: "__init__" is the package itself (its lazy public names).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("common", "errors"),
    ("machine",),
    ("engines",),
    ("rules",),
    ("config", "spec"),
    ("clients", "metrics", "prompts", "proxy", "sim"),
    ("running", "cluster", "assertions"),
    ("reuse",),
    ("glue", "plugin", "cli", "__init__"),
)
#: Imports against the order that another change removes: (importer, imported).
KNOWN_UPWARD: set[tuple[str, str]] = set()
#: The layer whose rooms may form a cycle among themselves (a knot): only these, so that no new one forms.
KNOWN_KNOTS: set[frozenset[str]] = {
    frozenset({"common", "errors"}),
    frozenset({"config", "spec"}),
    frozenset({"running", "cluster", "assertions"}),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    return ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _imports(tree: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import that can run, with whether it is inside a function (``if TYPE_CHECKING:`` bodies skipped)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for orelse in child.orelse:
                yield from _imports(orelse, in_function)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _imports(child, inside)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The package modules one import statement loads (``from a import b`` loads ``a.b`` when that is a module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level:
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join([*base, node.module] if node.module else base)
        else:
            prefix = node.module or ""
        names = [prefix, *(f"{prefix}.{alias.name}" for alias in node.names)]
    found = set()
    for name in names:
        while name and name not in known:  # `import a.b.c` loads a.b.c; a dotted name below it is an attribute
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported package module: line}, function-level imports included.

    An import of a module's own package (``from pytest_pdserve import assertions`` inside
    ``pytest_pdserve.assertions._measure``) is no edge: Python initializes a package before any module in it, so
    such an import never decides what loads first (a package ``__init__`` re-exporting its modules is the usual
    facade, and reading its knob at call time, ``assertions.SETTLE_TIMEOUT``, adds nothing to load).
    """
    modules = _modules()
    known = set(modules)
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node, _ in _imports(tree):
            for target in _targets(module, path.name == "__init__.py", node, known):
                if target != module and not module.startswith(target + "."):
                    graph[module].setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
    return found


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [f"{a} -> {b} (line {line})" for a in component for b, line in sorted(graph[a].items()) if b in component]
    return "; ".join(edges)


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    assert "pytest_pdserve.plugin" in graph
    unexpected = [c for c in cycles(graph) if frozenset(m.rpartition(".")[2] for m in c) not in KNOWN_CYCLES]
    assert not unexpected, "import cycles (function-level imports counted):\n" + "\n".join(
        _describe(c, graph) for c in unexpected
    )


def room(module: str) -> str:
    """The folder (or top-level module) of pytest_pdserve a module lives in; "__init__" for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, dict[str, int]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every import from a room into a room of a later layer, as "importer:line -> imported"."""
    rank = {r: i for i, rooms in enumerate(layers) for r in rooms}
    return [
        f"{a}:{line} -> {b}"
        for a, targets in sorted(graph.items())
        for b, line in sorted(targets.items())
        if rank[room(a)] < rank[room(b)]
    ]


def room_graph(graph: dict[str, dict[str, int]], leave_out: set[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """room -> {room it imports from: 0}, imports within a room and those in ``leave_out`` left out."""
    rooms: dict[str, dict[str, int]] = {room(m): {} for m in graph}
    for a, targets in graph.items():
        for b in targets:
            if room(a) != room(b) and (a, b) not in leave_out:
                rooms[room(a)][room(b)] = 0
    return rooms


def test_every_room_is_in_the_folder_order() -> None:
    placed = [r for rooms in LAYERS for r in rooms]
    assert len(placed) == len(set(placed)), "a room is in two layers"
    assert {room(m) for m in _modules()} == set(placed)


def test_imports_follow_the_folder_order() -> None:
    """No module imports from a later layer (function-level imports counted): the layers of docs/architecture.md."""
    graph = import_graph()
    found = upward_imports(graph, LAYERS)
    unexpected = [edge for edge in found if tuple(edge.replace(" -> ", ":").split(":")[::2]) not in KNOWN_UPWARD]
    assert not unexpected, "imports against the folder order (LAYERS, test_imports.py):\n" + "\n".join(unexpected)
    gone = {edge for edge in KNOWN_UPWARD if edge[1] not in graph.get(edge[0], {})}
    assert not gone, f"KNOWN_UPWARD lists imports that are gone, take them out: {sorted(gone)}"


def test_no_new_knot_of_rooms() -> None:
    """Rooms that import each other only where LAYERS says a knot is left (and it may only shrink)."""
    knots = [frozenset(c) for c in cycles(room_graph(import_graph(), KNOWN_UPWARD))]
    new = [sorted(k) for k in knots if not any(k <= known for known in KNOWN_KNOTS)]
    assert not new, f"rooms that import each other (a knot), not in KNOWN_KNOTS: {new}"


def test_the_order_check_sees_function_level_imports() -> None:
    """The check itself: an upward import inside a function is found; one under TYPE_CHECKING is not."""
    low = ast.parse("def f():\n    from pkg.high import mod\n")
    typed = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import mod\n")
    known = {"pkg", "pkg.low", "pkg.low.a", "pkg.low.b", "pkg.high", "pkg.high.mod"}
    graph = {
        "pkg.low.a": {t: 3 for n, _ in _imports(low) for t in _targets("pkg.low.a", False, n, known)},
        "pkg.low.b": {t: 3 for n, _ in _imports(typed) for t in _targets("pkg.low.b", False, n, known)},
        "pkg.high.mod": {},
    }
    assert upward_imports(graph, (("low",), ("high",))) == ["pkg.low.a:3 -> pkg.high", "pkg.low.a:3 -> pkg.high.mod"]
    assert upward_imports(graph, (("high",), ("low",))) == []
    assert cycles(room_graph({**graph, "pkg.high.mod": {"pkg.low.b": 1}}, set())) == [["high", "low"]]


def test_cycle_finder_sees_function_level_imports(tmp_path: Path) -> None:
    """The check itself: a cycle closed only by an import inside a function is found, one under TYPE_CHECKING is not."""
    a = ast.parse("import x.b\n")
    b = ast.parse("def f():\n    from x import a\n")
    c = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x import a\n")
    known = {"x", "x.a", "x.b", "x.c"}
    graph = {
        "x.a": {t: 1 for n, _ in _imports(a) for t in _targets("x.a", False, n, known)},
        "x.b": {t: 1 for n, _ in _imports(b) for t in _targets("x.b", False, n, known)},
        "x.c": {t: 1 for n, _ in _imports(c) for t in _targets("x.c", False, n, known)},
    }
    assert graph == {"x.a": {"x.b": 1}, "x.b": {"x": 1, "x.a": 1}, "x.c": {}}
    assert cycles(graph) == [["x.a", "x.b"]]


def _explained(lines: list[str], node: ast.Import | ast.ImportFrom) -> bool:
    """A comment on the import's own lines, or on the line right above it or above the run of imports it is in."""
    end = node.end_lineno or node.lineno
    if any("#" in lines[i - 1] for i in range(node.lineno, end + 1)):
        return True
    i = node.lineno - 1
    while i >= 1:
        text = lines[i - 1].strip()
        if text.startswith("#"):
            return True
        if not (text.startswith(("import ", "from ")) or text.endswith((",", "(")) or text == ")"):
            return False
        i -= 1
    return False


def test_every_function_level_import_says_why() -> None:
    """An import inside a function costs a lookup on each call and hides a dependency: it needs a reason."""
    silent = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name in KNOWN_UNEXPLAINED:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for node, in_function in _imports(ast.parse("\n".join(lines), str(path))):
            if in_function and not _explained(lines, node):
                silent.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not silent, "function-level imports without a comment saying why:\n" + "\n".join(silent)


def test_owned_flag_remedies_match_the_settings_table() -> None:
    """owned_flags.py spells out the remedies it names (the settings table imports it through spec.py)."""
    named = {f.setting for f in owned_flags.OWNED_FLAGS if f.setting is not None}
    assert set(owned_flags.SETTING_REMEDIES) == named
    for name, text in owned_flags.SETTING_REMEDIES.items():
        assert text == setting_table.remedy(name), name


_LOADED = """
import json, sys
import {module}
print(json.dumps(sorted(sys.modules)))
"""


def _loaded_by(module: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _LOADED.format(module=module)], capture_output=True, text=True, check=True, timeout=120
    )
    loaded: list[str] = json.loads(out.stdout)
    return loaded


@pytest.mark.parametrize("module", ["pytest_pdserve.plugin", "pytest_pdserve"])
def test_loading_the_plugin_imports_nothing_heavy(module: str) -> None:
    """pytest loads the plugin (its pytest11 entry point) for every run, collection included."""
    loaded = _loaded_by(module)
    heavy = sorted({m.split(".")[0] for m in loaded} & set(HEAVY))
    assert not heavy, f"importing {module} loads {heavy}"


def test_collection_imports_nothing_heavy(pytester: pytest.Pytester) -> None:
    """A whole --collect-only session with the plugin configured (settings, inventory, markers, fixtures)."""
    pytester.makeconftest(
        """
import json, sys

def pytest_collection_finish(session):
    print("LOADED=" + json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""
    )
    pytester.makepyfile("def test_a(pd_cluster):\n    pass\n\ndef test_b(pd_cluster_factory):\n    pass\n")
    result = pytester.runpytest_subprocess("--collect-only", "-q", "-s", "--pd-engine=sim")
    result.assert_outcomes()
    line = next(line for line in result.outlines if line.startswith("LOADED="))
    roots = set(json.loads(line.removeprefix("LOADED=")))
    assert "pytest_pdserve" in roots  # the plugin was loaded
    assert not roots & set(HEAVY), sorted(roots & set(HEAVY))
