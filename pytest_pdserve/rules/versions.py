"""vLLM versions as the rules compare them, and the table every version-dependent rule is written as. [stdlib]

A rule that changed between vLLM releases is a :class:`VersionTable`: rows keyed by the first release they hold for
(``since``), each checked in the source of the release it names. A version between two rows follows the earlier row
(the releases in between were not read); a version below the first row is ``None`` ("not known": the rule does not
apply). A 0.34 row is one more ``(since, value)`` pair.

Versions compare on their release numbers only: ``0.33.0rc1``, ``0.33.0.dev12+g1234`` and ``0.32.0+cpu`` are 0.33,
0.33 and 0.32. Stdlib only (no ``packaging``): the simulator imports the rules before it loads anything else.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["DEFAULT_VLLM_VERSION", "Release", "VersionTable", "parse_version", "release"]

Release = tuple[int, int, int]
"""``(major, minor, patch)`` of a vLLM version."""

T = TypeVar("T")

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")
_STRICT = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?([.+-].*|rc\d+.*)?$")

DEFAULT_VLLM_VERSION = "0.34.0"
"""The newest release every rule of this package was read in: the version the simulator reports and follows unless
``PDSERVE_SIM_VLLM_VERSION`` says otherwise."""


def release(version: object) -> Release:
    """``0.32.0``, ``0.33``, ``0.32.0+cpu``, ``0.33.0rc1``, a ``packaging`` Version or a tuple -> (major, minor, patch).

    :raises ValueError: not a vLLM version.
    """
    if isinstance(version, tuple):
        parts = [int(p) for p in version[:3]] + [0, 0, 0]
        return parts[0], parts[1], parts[2]
    match = _VERSION.match(str(version).strip())
    if match is None:
        raise ValueError(f"{version!r} is not a vLLM version like 0.33.0")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def parse_version(text: str) -> Release:
    """A version a user sets (``PDSERVE_SIM_VLLM_VERSION``): ``0.32.0``, ``0.33``, ``0.32.0+cpu``, ``0.33.0rc1``;
    nothing after the release but a local, pre or dev part.

    :raises ValueError: anything else.
    """
    match = _STRICT.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a vLLM version like 0.33.0")
    major, minor, patch, _tail = match.groups()
    return int(major), int(minor), int(patch or 0)


def shown(version: object) -> str:
    """``0.32`` for 0.32.0, ``0.32.1`` for 0.32.1: how messages name a release."""
    major, minor, patch = release(version)
    return f"{major}.{minor}" if patch == 0 else f"{major}.{minor}.{patch}"


@dataclass(frozen=True)
class VersionTable(Generic[T]):
    """Rows ``(since, value)``; :meth:`at` is the value of the newest row a version has reached."""

    rows: tuple[tuple[Release, T], ...]

    @classmethod
    def of(cls, rows: Iterable[tuple[str, T]]) -> VersionTable[T]:
        """``VersionTable.of([("0.26", a), ("0.32", b)])``: rows by the release they start at."""
        return cls(tuple(sorted(((release(since), value) for since, value in rows), key=lambda row: row[0])))

    def at(self, version: object) -> T | None:
        """The value for ``version``; ``None`` below the first row."""
        found: T | None = None
        wanted = release(version)
        for since, value in self.rows:
            if since <= wanted:
                found = value
        return found

    @property
    def first(self) -> Release:
        """The oldest release a row was read in."""
        return self.rows[0][0]
