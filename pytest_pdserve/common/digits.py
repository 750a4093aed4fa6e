"""The one rule for numbers read from text a user gave: ASCII digits only. [pytest-free, stdlib]

``int()`` and ``float()`` also take ``'1_000'`` and other scripts' digits (``'٢'``, ``'１２'``), and
``str.isdigit()`` says yes to ``'²'``, which ``int()`` then refuses. The README promises digits 0-9, so every
setting, every environment variable a preset or the simulator reads and the GPU visibility variables are parsed
here, and the same text means the same number wherever it is given.
"""

from __future__ import annotations

import re

__all__ = ["is_int", "parse_float", "parse_int"]

# [0-9], not \d: \d matches every script's decimal digits.
_INT = re.compile(r"[0-9]+")
_FLOAT = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def is_int(text: str) -> bool:
    """Whether *text* (surrounding whitespace ignored) is a whole number >= 0 in ASCII digits."""
    return _INT.fullmatch(text.strip()) is not None


def parse_int(text: str) -> int:
    """A whole number >= 0 in ASCII digits (surrounding whitespace ignored).

    :raises ValueError: anything else: a sign, underscores, other digits, a fraction.
    """
    if not is_int(text):
        raise ValueError(f"{text!r} is not a whole number in digits 0-9")
    return int(text.strip())


def parse_float(text: str) -> float:
    """A number >= 0 in ASCII digits, with an optional fraction and exponent (``0.5``, ``.5``, ``1e3``).

    No sign, ``nan``, ``inf`` or underscores; an exponent too large is ``inf``, which callers' bounds refuse.

    :raises ValueError: anything else.
    """
    value = text.strip()
    if _FLOAT.fullmatch(value) is None:
        raise ValueError(f"{text!r} is not a number in digits 0-9 (e.g. 0.5 or 30)")
    return float(value)
