"""Text the plugin hands to the operating system (argv, environment, paths) under the locale Python runs in: one
rule for what cannot be handed over, and words that name the real cause. [pytest-free, stdlib only]

Python decodes the command line and the environment, and encodes file names, argv and environment values, with
the file-system encoding, which follows the locale: UTF-8 in UTF-8 mode (``PYTHONUTF8=1``, or the C locale
without ``PYTHONUTF8=0``, PEP 540), else the locale's own (ASCII under ``LC_ALL=C PYTHONUTF8=0``). So
``--pd-log-dir=/tmp/логи`` is valid UTF-8 on the command line yet arrives undecodable under ``LC_ALL=C
PYTHONUTF8=0``, and the same value read from a UTF-8 ini file cannot be given back to the OS as a file name. Both
are the locale's doing, not the value's: :func:`os_text_problem` says so, with what to do.
"""

from __future__ import annotations

import os
import sys

__all__ = ["locale_words", "os_text_problem"]

_REMEDY = "run pytest under a UTF-8 locale (LC_ALL=C.UTF-8) or with PYTHONUTF8=1"


def locale_words() -> str:
    """The encoding Python uses with the OS here and why, e.g. ``ascii (LC_ALL=C, UTF-8 mode off: PYTHONUTF8=0)``."""
    encoding = sys.getfilesystemencoding()
    var = next((f"{k}={os.environ[k]}" for k in ("LC_ALL", "LC_CTYPE", "LANG") if os.environ.get(k)), None)
    utf8 = os.environ.get("PYTHONUTF8")
    mode = "UTF-8 mode on" if sys.flags.utf8_mode else f"UTF-8 mode off{': PYTHONUTF8=' + utf8 if utf8 else ''}"
    return f"{encoding} ({var or 'no LC_ALL, LC_CTYPE or LANG'}, {mode})"


def os_text_problem(value: str) -> str | None:
    """Why ``value`` cannot go to the OS as an argument, an environment value or a file name, naming the locale when
    the locale is the cause; None when it can. (NUL bytes and sizes are the callers' rules.)"""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates: bytes the file-system encoding could not decode (surrogateescape) on their way in.
        try:
            raw = os.fsencode(value)
        except UnicodeError:
            return "it is not valid UTF-8 (undecodable bytes)"
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return f"it is not valid UTF-8 (the bytes {_first_bad(raw)} are not)"
        return (
            f"its bytes are valid UTF-8, but Python read them as {locale_words()}, which cannot decode them; {_REMEDY}"
        )
    try:
        os.fsencode(value)
    except UnicodeEncodeError as exc:
        return (
            f"it holds {value[exc.start : exc.end]!r}, which Python cannot give the operating system as "
            f"{locale_words()}; {_REMEDY}"
        )
    return None


def _first_bad(raw: bytes) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return repr(raw[exc.start : exc.end + 3])
    return repr(raw[:8])  # pragma: no cover - only called on bytes that do not decode
