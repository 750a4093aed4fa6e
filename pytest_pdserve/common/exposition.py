"""A fast reader of the Prometheus text exposition that vLLM's ``/metrics`` writes, giving exactly what
prometheus_client's parser gives, or ``None`` where it cannot promise that.

Why: ``prometheus_client.parser`` (0.26) reads label sets one character at a time: 4-9 ms for the simulator's
157 samples on the 2-core CI machine, more for real vLLM, and every start's read-back, P/D-ready round trip and
metric assertion parses whole scrapes (docs/benchmarks.md has the figures). This reader takes the strict
subset that prometheus_client's own ``generate_latest`` writes (legacy names, ``name="value"`` labels with no
spaces, one space before the value and before an optional timestamp, ``# HELP`` / ``# TYPE`` comments) a line
at a time with regexes, and replays the reference parser's family bookkeeping, so the samples, their names (a
``counter`` family not named ``..._total`` renames its samples, as the reference does) and the order in which
they come out are the reference's. Any line outside that subset returns ``None``: the caller then parses the
whole text with prometheus_client, which also owns every error message. tests/common/test_exposition.py compares the
two on real vLLM scrapes and on generated texts. [pytest-free, stdlib]
"""

from __future__ import annotations

import re

__all__ = ["parse_samples"]

#: One sample, as prometheus_client's text parser yields it: (exact name, its label pairs, value).
ParsedSample = tuple[str, frozenset[tuple[str, str]], float]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
# Label names as the reference takes them unquoted, less those it refuses (``__`` reserved) and the ``:`` it
# happens to allow: the rare rest goes to the reference.
_LABEL = r'(?!__)[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*(?:\\.[^"\\]*)*"'
# ASCII numbers and the specials prometheus_client writes; at most 40 characters, so the reference's int() ->
# float() cannot overflow where float() of the text would not.
_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?|Inf|NaN)"
_SAMPLE = re.compile(rf"({_NAME})(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})? ({_NUMBER})(?: {_NUMBER})?")
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*(?:\\.[^"\\]*)*)"')
_HELP = re.compile(rf"# HELP ({_NAME})(?: .*)?")
_TYPE = re.compile(rf"# TYPE ({_NAME}) ([a-z]+)")
# The reference's unescaping, left to right: \\ -> \, \n -> newline, \" -> "; any other backslash stays.
_ESCAPE = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}
_NO_LABELS: frozenset[tuple[str, str]] = frozenset()


def _unescape(match: re.Match[str]) -> str:
    return _UNESCAPED[match.group(0)]


# Sample names a family of each type keeps (others start an untyped family of one), as the reference has them.
_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "summary": ("_count", "_sum", ""),
    "histogram": ("_count", "_sum", "_bucket"),
}
_MAX_NUMBER = 40


def parse_samples(text: str) -> list[ParsedSample] | None:
    """Every sample of ``text`` in the order prometheus_client's ``text_string_to_metric_families`` yields them
    (family by family), or ``None`` when a line is outside the subset this reader promises to read as it does."""
    out: list[ParsedSample] = []
    family = ""
    kind = "untyped"
    pending: list[ParsedSample] = []
    allowed: tuple[str, ...] = ()

    def close() -> None:
        # build_metric: a counter family whose name lacks _total has "_total" added to each of its samples.
        rename = kind == "counter" and not family.endswith("_total")
        out.extend(
            (f"{name}_total", labels, value) if rename else (name, labels, value) for name, labels, value in pending
        )

    for raw in text.split("\n"):  # the reference reads io.StringIO(text) line by line: "\n" alone ends a line
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            m = _HELP.fullmatch(line)
            if m is not None:
                if m.group(1) != family:
                    if family:
                        close()
                    family, kind, pending, allowed = m.group(1), "untyped", [], (m.group(1),)
                continue
            m = _TYPE.fullmatch(line)
            if m is None:
                return None
            if m.group(1) != family:
                if family:
                    close()
                family, pending = m.group(1), []
            kind = m.group(2)
            allowed = tuple(family + suffix for suffix in _SUFFIXES.get(kind, ("",)))
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            return None
        name, label_text, number = m.group(1), m.group(2), m.group(3)
        if len(number) > _MAX_NUMBER or len(line) - m.end(3) > _MAX_NUMBER + 1:
            return None
        labels: frozenset[tuple[str, str]] = _NO_LABELS
        if label_text:
            pairs = _PAIR.findall(label_text)
            if "\\" in label_text:
                pairs = [(k, _ESCAPE.sub(_unescape, v)) for k, v in pairs]
            if len(pairs) > 1 and len(dict(pairs)) != len(pairs):
                return None  # a label given twice: the reference refuses the line
            labels = frozenset(pairs)
        # The reference takes int(number), else float(number), and the caller float()s it. For these numbers
        # float(number) is that same double (both round the exact value once) but for the sign of an integer zero.
        value = float(number)
        if not value and number[0] == "-" and number[1:].isdigit():
            value = 0.0
        sample = (name, labels, value)
        if name in allowed:
            pending.append(sample)
        else:
            # Not of the current family: the reference closes it and yields this sample alone, untyped, at once.
            if family:
                close()
            family, kind, pending, allowed = "", "untyped", [], ()
            out.append(sample)
    if family:
        close()
    return out
