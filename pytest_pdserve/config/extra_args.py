"""Parse ``VLLM_SERVE_EXTRA_ARGS`` into an argv tuple.

vLLM's P/D scripts split the variable on commas (``IFS=','``), e.g.
``--max-model-len,8192,--trust-remote-code``. People also write it the way a shell would,
e.g. ``--max-model-len 8192 --foo 'a b'``. Both forms are accepted; the rule that tells them
apart is:

* **Comma form**: the value contains a comma and no quote character (``'`` or ``"``).
  It is split on commas; each piece is stripped of surrounding whitespace and empty pieces are
  dropped. A piece that starts with ``--`` and contains whitespace (``--max-model-len 32768``,
  as vLLM's Kimi CI step writes it) is split at its first run of whitespace into the flag and
  its value. Any other piece stays one argv element exactly as written, so
  ``--served-model-name,x; rm -rf /`` gives ``("--served-model-name", "x; rm -rf /")``.
* **Shell form**: anything else. The value is split with :func:`shlex.split` (POSIX rules:
  quotes group words, backslash escapes). Unbalanced quotes are an error.

Nothing is ever handed to a shell: the result is an argv list for ``subprocess``. Which flags the
result may not contain is the owned-flags table's business (:mod:`pytest_pdserve.config.owned_flags`).
This module is pytest-free.
"""

from __future__ import annotations

import shlex

from pytest_pdserve.errors import ExtraArgsError

__all__ = ["is_comma_form", "parse_extra_args"]

_QUOTES = ("'", '"')


def is_comma_form(value: str) -> bool:
    """Return True when *value* is in vLLM's comma-separated form (see the module docstring)."""
    return "," in value and not any(q in value for q in _QUOTES)


def _split_comma_form(value: str) -> tuple[str, ...]:
    argv: list[str] = []
    for raw in value.split(","):
        piece = raw.strip()
        if not piece:
            continue
        if piece.startswith("--") and any(c.isspace() for c in piece):
            # "--max-model-len 32768": a flag and its value written in one comma piece.
            flag, rest = piece.split(None, 1)
            argv.extend((flag, rest))
        else:
            argv.append(piece)
    return tuple(argv)


def parse_extra_args(value: str) -> tuple[str, ...]:
    """Split an extra-args string into argv elements.

    :param value: the raw string (from ``VLLM_SERVE_EXTRA_ARGS``, a flag or an ini key).
    :returns: the argv elements, possibly empty.
    :raises ExtraArgsError: the shell form has unbalanced quotes or a dangling backslash.
    """
    if is_comma_form(value):
        return _split_comma_form(value)
    try:
        return tuple(shlex.split(value, posix=True))
    except ValueError as exc:  # shlex says "No closing quotation" / "No escaped character"
        raise ExtraArgsError(
            f"cannot split {value!r} into arguments ({exc}); use the comma form "
            "'--flag,value,--other-flag' or balanced shell quoting '--flag \"a b\"'"
        ) from None
