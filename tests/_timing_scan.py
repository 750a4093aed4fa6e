"""The shapes of a verdict that depends on how fast the machine is, found in test source with ``ast``.

A test must wait for the condition it is about; where it bounds that wait, the bound is one a loaded machine cannot
reach. The scan finds the shapes that broke on loaded machines before (tests/project/test_timing_rules.py runs it over
tests/ and examples/, the inner sessions' code in string literals included):

* ``inner-timeout``: an inner session given ``--timeout=N`` (argv, ``-o timeout=N``, an ini line) or a
  ``pytest.mark.timeout(N)`` below :data:`TIMEOUT_FLOOR_S`: its clock runs through pytest's start, fixture setup and
  teardown, and fires wherever a slow machine happens to be (issue 42: during the cluster's start). Allowed with
  ``timeout_func_only=true`` in the same statement: the clock then runs only in a test body the test controls.
* ``elapsed-bound``: an ``assert`` that bounds a measured duration from above by a constant below
  :data:`BOUND_FLOOR_S`, or compares two measured durations (one process faster than another). Lower bounds
  (``took >= timeout``: never early) are not speed: a timer cannot fire before its time.
* ``short-deadline``: ``time.monotonic() + N`` with ``N`` below :data:`BOUND_FLOOR_S`.
* ``short-wait``: a wait whose bound decides the verdict, below :data:`BOUND_FLOOR_S`: a ``timeout=N`` argument,
  or the bound of ``wait_for`` / ``wait_until`` / ``gone_within`` / ``.wait`` / ``.join`` / ``.communicate`` /
  ``signal.alarm``. ``timeout=0`` (do not wait) is not a wait.
* ``bare-sleep``: ``time.sleep`` / ``asyncio.sleep`` as a statement outside a loop: a sleep standing in for a
  condition (a sleep inside a polling loop is the loop's interval; ``sleep(0)`` yields to the event loop and waits
  for nothing).

Some such lines are right: the duration is what the test measures or holds on purpose (an idle window, a deadline
under test whose condition can never be met). Each carries ``# timing: <why>`` on one of its lines, so a reader
sees the claim, and the scan accepts it. The floors: see :data:`TIMEOUT_FLOOR_S` and :data:`BOUND_FLOOR_S`.
"""

from __future__ import annotations

import ast
import io
import math
import re
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: The least ``--timeout`` an inner session may be given (pytest-timeout's clock covers a test's setup and
#: teardown). What it bills besides the paused start and stop took over 3 s at load average 16-18 on 2 cores
#: (docs/benchmarks.md, "Verdicts on a loaded machine"); 60 s is an order of magnitude above.
TIMEOUT_FLOOR_S = 60.0
#: The least upper bound on a measured duration, a deadline or a wait: the waits it bounds take milliseconds to a
#: few seconds quiet and at most a few times that loaded; 30 s is the margin ``GONE_WITHIN_S`` set first.
BOUND_FLOOR_S = 30.0

PRAGMA = re.compile(r"#\s*timing:\s*\S")
#: Names whose value is a duration (``took``, ``report.term_seconds``, ``info["started_seconds"]``).
DURATION_NAME = re.compile(r"(^|_)(seconds|elapsed|took|latenc(y|ies)|waited|duration|ran)$|_at$")
TIME_CALLS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns"}
WAIT_FUNCS = {"wait_for": 1, "wait_until": 1, "wait_all_gone": 1, "gone_within": 0, "wait_info": 0, "log_value": 2}
HTTPX_CALLS = {"get", "post", "put", "patch", "delete", "head", "options", "request", "stream", "Client", "AsyncClient"}
#: ``Thread.join(N)`` is left out: it returns after N s whatever happened, and decides nothing by itself.
WAIT_METHODS = {"wait": 0, "communicate": 1}
INNER_TIMEOUT = re.compile(r"(?:--timeout[= ]|(?:^|\n|-o\s?)\s*timeout\s*=\s*)(\d+(?:\.\d+)?)\b", re.MULTILINE)
MARK_TIMEOUT = re.compile(r"mark\.timeout\(\s*(\d+(?:\.\d+)?)")
FUNC_ONLY = re.compile(r"func_only\s*=\s*[Tt]rue")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.text}"


def _pragma_lines(source: str) -> set[int]:
    """The lines that carry ``# timing: <why>``; a comment alone on its line counts for the line below it too."""
    lines: set[int] = set()
    text = source.splitlines()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT and PRAGMA.search(tok.string):
                lines.add(tok.start[0])
                if text[tok.start[0] - 1].strip().startswith("#"):
                    lines.add(tok.start[0] + 1)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return lines


def _yields(call: ast.Call) -> bool:
    """``sleep(0)``: a turn of the event loop given away, no wait."""
    return len(call.args) == 1 and isinstance(call.args[0], ast.Constant) and call.args[0].value == 0


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


class _Scope:
    """Module-level numeric constants (``GONE_WITHIN_S = 30.0``), to read bounds written as names."""

    def __init__(self, tree: ast.Module) -> None:
        self.constants: dict[str, float] = {}
        for stmt in tree.body:
            targets: list[ast.expr] = []
            if isinstance(stmt, ast.Assign):
                targets, value = stmt.targets, stmt.value
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                targets, value = [stmt.target], stmt.value
            else:
                continue
            number = self.number(value)
            for target in targets:
                if isinstance(target, ast.Name) and number is not None:
                    self.constants[target.id] = number

    def number(self, node: ast.expr) -> float | None:
        """The value of a constant expression (numbers, known names, + - * /, unary minus), or None."""
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.Name):
            return self.constants.get(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = self.number(node.operand)
            return None if inner is None else -inner
        if isinstance(node, ast.BinOp):
            left, right = self.number(node.left), self.number(node.right)
            if left is None or right is None:
                return None
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if isinstance(node.op, ast.Div) and right:
                return left / right
        return None


def _is_time_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _call_name(node) in TIME_CALLS and not node.args


def _timed_names(func: ast.AST) -> set[str]:
    """Names a function assigns from an expression that reads the clock or a duration (``took = time.monotonic() -
    t0``, ``teardown = inner.session_finished_at() - info["end"]``)."""
    names: set[str] = set()
    for _ in range(3):  # a name assigned from a timed name is timed too (a short chain)
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and _is_duration(node.value, names):
                for target in node.targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _is_duration(node: ast.expr, timed: set[str]) -> bool:
    """Whether an expression is a measured duration: it reads the clock, or names a timed value or a duration."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and _call_name(sub) in ("len", "count"):
            return False  # a count of things, whatever it counts
        if _is_time_call(sub):
            return True
        if isinstance(sub, ast.Name) and (sub.id in timed or DURATION_NAME.search(sub.id)):
            return True
        if isinstance(sub, ast.Attribute) and DURATION_NAME.search(sub.attr):
            return True
        if isinstance(sub, ast.Call) and DURATION_NAME.search(_call_name(sub)):
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and DURATION_NAME.search(sub.value):
            return True
    return False


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, tree: ast.Module, pragmas: set[int], line_offset: int) -> None:
        self.path, self.pragmas, self.offset = path, pragmas, line_offset
        self.scope = _Scope(tree)
        self.findings: list[Finding] = []
        self.timed: set[str] = set()
        self.loops = 0
        self.polls = 0

    def _flag(self, node: ast.AST, rule: str) -> None:
        first = getattr(node, "lineno", 1)
        last = getattr(node, "end_lineno", first) or first
        if any(line in self.pragmas for line in range(first, last + 1)):
            return
        text = ast.unparse(node) if isinstance(node, ast.AST) else ""
        self.findings.append(Finding(self.path, first + self.offset, rule, text.splitlines()[0][:140]))

    def _below(self, node: ast.expr | None, floor: float) -> bool:
        value = None if node is None else self.scope.number(node)
        return value is not None and 0 < value < floor and math.isfinite(value)

    # -- scopes
    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:  # noqa: N802 (ast API)
        outer, loops, polls = self.timed, self.loops, self.polls
        self.timed, self.loops, self.polls = outer | _timed_names(node), 0, 0
        self.generic_visit(node)
        self.timed, self.loops, self.polls = outer, loops, polls

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815 (ast API)

    def _loop(self, node: ast.For | ast.While | ast.AsyncFor) -> None:
        # A polling loop (`while`, `for _ in range(n)`): a wait inside it is one attempt, bounded by the loop's own.
        poll = isinstance(node, ast.While) or (
            isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and _call_name(node.iter) == "range"
        )
        self.loops += 1
        self.polls += poll
        self.generic_visit(node)
        self.loops -= 1
        self.polls -= poll

    visit_For = visit_While = visit_AsyncFor = _loop  # noqa: N815 (ast API)

    # -- the shapes
    def visit_Assert(self, node: ast.Assert) -> None:  # noqa: N802 (ast API)
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            operands = [compare.left, *compare.comparators]
            for left, op, right in zip(operands, compare.ops, operands[1:], strict=False):
                if isinstance(op, (ast.Gt, ast.GtE)):
                    left, right = right, left  # read every comparison as `small < big`
                elif not isinstance(op, (ast.Lt, ast.LtE)):
                    continue
                if _is_time_call(left) or _is_time_call(right):
                    continue  # `time.monotonic() < deadline`: a deadline check (short-deadline reads the deadline)
                small, big = _is_duration(left, self.timed), _is_duration(right, self.timed)
                if small and big:
                    self._flag(node, "elapsed-bound")  # one measured duration against another
                elif small and self._below(right, BOUND_FLOOR_S):
                    self._flag(node, "elapsed-bound")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:  # noqa: N802 (ast API)
        if isinstance(node.op, ast.Add) and _is_time_call(node.left) and self._below(node.right, BOUND_FLOOR_S):
            self._flag(node, "short-deadline")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802 (ast API)
        name = _call_name(node)
        bound: ast.expr | None = None
        for keyword in node.keywords:
            if keyword.arg == "timeout" and name != "join":
                bound = keyword.value
        if bound is None and isinstance(node.func, ast.Name) and name in WAIT_FUNCS:
            index = WAIT_FUNCS[name]
            bound = node.args[index] if len(node.args) > index else None
        if bound is None and isinstance(node.func, ast.Attribute) and name in WAIT_METHODS:
            index = WAIT_METHODS[name]
            bound = node.args[index] if len(node.args) > index else None
        if bound is None and name == "alarm" and node.args:
            bound = node.args[0]
        if self._below(bound, BOUND_FLOOR_S) and not self.polls:
            self._flag(node, "short-wait")
        if self._httpx_default_timeout(node):
            self._flag(node, "short-wait")
        is_mark = name == "timeout" and isinstance(node.func, ast.Attribute) and node.args
        if is_mark and self._below(node.args[0], TIMEOUT_FLOOR_S):  # @pytest.mark.timeout(N)
            self._flag(node, "inner-timeout")
        self.generic_visit(node)

    @staticmethod
    def _httpx_default_timeout(node: ast.Call) -> bool:
        """``httpx.get(url)`` or ``httpx.Client()`` to a real socket without ``timeout=``: httpx's own 5 s."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "httpx"):
            return False
        if func.attr not in HTTPX_CALLS:
            return False
        return not any(k.arg in ("timeout", "transport") or k.arg is None for k in node.keywords)

    def visit_Expr(self, node: ast.Expr) -> None:  # noqa: N802 (ast API)
        value = node.value.value if isinstance(node.value, ast.Await) else node.value
        if isinstance(value, ast.Call) and _call_name(value) == "sleep" and not self.loops and not _yields(value):
            self._flag(node, "bare-sleep")
        self.generic_visit(node)


def _strings(tree: ast.AST, scope: _Scope) -> Iterator[tuple[str, int, ast.stmt]]:
    """Every string literal (an f-string with the module constants it names filled in) with its first line and the
    statement it is in."""
    for stmt in ast.walk(tree):
        if not isinstance(stmt, ast.stmt) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            continue  # a docstring is prose
        parts: set[int] = set()  # the pieces of an f-string, read with it
        for node in ast.iter_child_nodes(stmt):
            if isinstance(node, ast.stmt):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.JoinedStr):
                    text = ""
                    for value in sub.values:
                        parts.add(id(value))
                        if isinstance(value, ast.Constant):
                            text += str(value.value)
                        elif isinstance(value, ast.FormattedValue):
                            number = scope.number(value.value)
                            text += "{}" if number is None else f"{number:g}"
                    yield text, sub.lineno, stmt
                elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and id(sub) not in parts:
                    yield sub.value, sub.lineno, stmt


def _inner_timeouts(path: str, tree: ast.Module, source: str, pragmas: set[int], offset: int) -> list[Finding]:
    """``--timeout`` / ``timeout =`` / ``mark.timeout(...)`` in string literals: an inner session's clock."""
    findings: list[Finding] = []
    lines = source.splitlines()
    for text, lineno, stmt in _strings(tree, _Scope(tree)):
        matches = [
            m
            for m in (*INNER_TIMEOUT.finditer(text), *MARK_TIMEOUT.finditer(text))
            if 0 < float(m.group(1)) < TIMEOUT_FLOOR_S
        ]
        if not matches:
            continue
        first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
        statement = "\n".join(lines[first - 1 : last])
        if FUNC_ONLY.search(statement) or any(line in pragmas for line in range(first, last + 1)):
            continue
        inner_pragmas = _pragma_lines(text)
        for match in matches:
            line = text.count("\n", 0, match.start())
            if line + 1 not in inner_pragmas:
                findings.append(Finding(path, lineno + line + offset, "inner-timeout", match.group(0).strip()))
    return findings


def scan_source(source: str, path: str, line_offset: int = 0) -> list[Finding]:
    """Every finding in one module's source (and, one level down, in the inner code its string literals hold)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    pragmas = _pragma_lines(source)
    scanner = _Scanner(path, tree, pragmas, line_offset)
    scanner.visit(tree)
    findings = scanner.findings + _inner_timeouts(path, tree, source, pragmas, line_offset)
    if line_offset == 0:  # inner code: a string literal that is a module (an inner test file, a script)
        for text, lineno, _ in _strings(tree, scanner.scope):
            if "\n" in text and re.search(r"^\s*(def |import |from \S+ import )", text, re.MULTILINE):
                inner = textwrap.dedent(text)
                for finding in scan_source(inner, path, lineno - 1):
                    if finding.rule != "inner-timeout":  # found above, in the outer statement's context
                        findings.append(finding)
    return sorted(set(findings), key=lambda f: (f.path, f.line, f.rule))


def scan_paths(root: Path, paths: list[Path]) -> list[Finding]:
    findings: list[Finding] = []
    for path in paths:
        findings += scan_source(path.read_text(), str(path.relative_to(root)))
    return findings
