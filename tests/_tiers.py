"""The unit tier: the tests that start no process (no server, no inner pytest, no subprocess), told apart from the
source, so that a test added tomorrow is classified as it is written (README "Development" runs ``-m unit``).

A test starts processes when the code it runs mentions a process-starting API (:data:`STARTS_PROCESSES`) or asks
for a fixture that does (:data:`PROCESS_FIXTURES`, or a tests/ fixture whose code mentions one). The code a test
runs is read with ``ast``: its function (decorators and parameters included), the fixtures it requests, and, one
name at a time, every function, class or constant of tests/ those use. The plugin's own code is not read: a product
function that starts a process is named in :data:`STARTS_PROCESSES`. What the reading misses, the tripwire catches:
in every run, a test of the unit tier that starts a process fails (tests/conftest.py), naming what it started.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

#: Names (functions, methods, classes, modules) whose use starts a process: the standard library's, and the plugin's
#: own that spawn one (a server, the watchdog, a guard, an inventory probe, the vLLM venv's python).
STARTS_PROCESSES = frozenset(
    {
        # the standard library
        "subprocess", "Popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "multiprocessing", "system",
        "create_subprocess_exec", "create_subprocess_shell", "spawnv_passfds", "execv", "execvp", "execve",
        # pytest's inner sessions in a subprocess
        "runpytest_subprocess", "spawn_pytest", "spawn", "popen",
        # the plugin's
        "ServerProcess", "Watchdog", "start_guard", "run_command", "ensure_tiny_model", "vllm_python",
        "resolve_engine", "get_inventory", "detect_inventory", "start_proxy", "launch",
        "installed_vllm_version",  # asks a non-venv interpreter
    }
)  # fmt: skip
#: Fixtures that start processes (pytester runs inner sessions; the clusters are servers).
PROCESS_FIXTURES = frozenset(
    {
        "pytester", "testdir", "pd_cluster", "pd_cluster_factory", "real_vllm", "real_pd_cluster", "tiny_llama_dir",
        "pd_cluster_session",
    }
)  # fmt: skip


#: tests/conftest.py's autouse fixtures, read as what they are: one fetches pytester only for a test that already
#: asked for it, the other is this tier's tripwire (it names the very calls it forbids).
INFRASTRUCTURE_FIXTURES = frozenset({"_inner_sessions_load_no_hypothesis", "_unit_tests_start_no_process"})


class _Module:
    """One tests/ file: its top-level definitions, and where the names it imports from tests/ come from."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tree = ast.parse(path.read_text())
        self.defs: dict[str, ast.AST] = {}
        self.imports: dict[str, tuple[Path, str]] = {}
        self.modules: dict[str, Path] = {}  # `import _flags`: a tests/ module used as `_flags.outcome(...)`
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            self.defs[name.id] = node
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                source = _tests_module(path, node.module, node.level)
                if source is not None:
                    for alias in node.names:
                        self.imports[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    source = _tests_module(path, alias.name, 0)
                    if source is not None:
                        self.modules[alias.asname or alias.name] = source

    def find(self, qualname: str) -> ast.AST | None:
        """A function by its qualified name (``Class.method`` too)."""
        node: ast.AST | None = None
        scope: list[ast.stmt] = self.tree.body
        for part in qualname.split("."):
            node = next((n for n in scope if getattr(n, "name", None) == part), None)
            if node is None:
                return None
            scope = getattr(node, "body", [])
        return node


def _tests_module(importer: Path, module: str, level: int) -> Path | None:
    """The file under tests/ that ``from <module> import ...`` in ``importer`` reads, or None (not a tests/ file)."""
    base = importer.parent if level else TESTS
    for _ in range(max(level - 1, 0)):
        base = base.parent
    candidate = base.joinpath(*module.split(".")).with_suffix(".py")
    if level == 0 and not candidate.exists():
        candidate = importer.parent.joinpath(*module.split(".")).with_suffix(".py")
    return candidate if candidate.exists() and TESTS in candidate.parents else None


@cache
def _module(path: Path) -> _Module:
    return _Module(path)


def _names(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            yield sub.id
        elif isinstance(sub, ast.Attribute):
            yield sub.attr
        if (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr == "getfixturevalue"
            and sub.args
            and isinstance(sub.args[0], ast.Constant)
            and isinstance(sub.args[0].value, str)
        ):
            yield sub.args[0].value  # request.getfixturevalue("pd_cluster"): a fixture asked for by name


def _reason_in_code(start: list[tuple[_Module, ast.AST]]) -> str | None:
    """What process-starting name the code reachable from ``start`` mentions (one name at a time), or None."""
    seen: set[tuple[Path, int]] = set()
    todo = list(start)
    while todo:
        module, node = todo.pop()
        key = (module.path, id(node))
        if key in seen:
            continue
        seen.add(key)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in module.modules:
                other = _module(module.modules[sub.value.id])
                if sub.attr in other.defs:
                    todo.append((other, other.defs[sub.attr]))
        for name in _names(node):
            if name in STARTS_PROCESSES or name in PROCESS_FIXTURES:
                where = module.path.relative_to(TESTS.parent) if TESTS in module.path.parents else module.path
                return f"{name} ({where}:{getattr(node, 'lineno', '?')})"
            if name in module.defs:
                todo.append((module, module.defs[name]))
            elif name in module.imports:
                path, original = module.imports[name]
                other = _module(path)
                if original in other.defs:
                    todo.append((other, other.defs[original]))
    return None


def _code_of(func: object) -> tuple[_Module, ast.AST] | None:
    """The tests/ source of a test or fixture function."""
    func = inspect.unwrap(func)  # type: ignore[arg-type]
    try:
        path = Path(inspect.getsourcefile(func) or "").resolve()  # type: ignore[arg-type]
    except TypeError:
        return None
    if TESTS not in path.parents or not path.exists():
        return None
    module = _module(path)
    node = module.find(getattr(func, "__qualname__", "").replace(".<locals>", ""))
    return None if node is None else (module, node)


def process_reason(item: pytest.Item) -> str | None:
    """Why ``item`` is not a unit test (what starts a process), or None when it starts none."""
    fixtures = [name for name in getattr(item, "fixturenames", ()) if name in PROCESS_FIXTURES]
    if fixtures:
        return f"fixture {fixtures[0]}"
    start: list[tuple[_Module, ast.AST]] = []
    function = getattr(item, "function", None)
    code = _code_of(function) if function is not None else None
    if code is None:
        return "not a test function of tests/"
    start.append(code)
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        if name in INFRASTRUCTURE_FIXTURES:
            continue
        for fixturedef in info.name2fixturedefs.get(name, ()) if info is not None else ():
            fixture = _code_of(fixturedef.func)
            if fixture is not None:
                start.append(fixture)
    return _reason_in_code(start)


def forbid_processes(monkeypatch: pytest.MonkeyPatch, nodeid: str) -> None:
    """Make every way of starting a process fail the running test: ``fork`` (``multiprocessing``'s fork, ``os.fork``),
    and the ``fork_exec`` that ``subprocess``, ``asyncio``'s subprocesses and ``multiprocessing``'s spawn go through."""
    import _posixsubprocess
    import os
    import subprocess

    def refuse(what: str) -> object:
        def started(*args: object, **kwargs: object) -> object:
            shown = next((a for a in args if isinstance(a, (list, tuple, bytes, str))), "")
            pytest.fail(
                f"{nodeid} is in the unit tier (tests/_tiers.py found nothing in its code that starts a process), "
                f"but it started one: {what} {shown!r}. Name what started it in tests/_tiers.py STARTS_PROCESSES.",
                pytrace=True,
            )

        return started

    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"os.{name}"))
    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse("fork_exec"))
    if hasattr(subprocess, "_fork_exec"):  # subprocess's own reference to it (3.11+)
        monkeypatch.setattr(subprocess, "_fork_exec", refuse("subprocess"))
