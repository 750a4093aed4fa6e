"""One redaction rule for everything pdserve prints, writes or attaches: secrets become ``***``.

What is hidden:

* every registered secret value (the API key; :func:`register`), wherever it appears: argv elements,
  environment values, captured server log text (vLLM prints ``non-default args: {... 'api_key': ...}``),
  error messages. Values of 8 characters or more are hidden everywhere; shorter ones only as a whole
  token (not inside a longer word), so a one-letter test key does not garble a whole log;
* the value after a secret flag (:data:`SECRET_FLAGS`: ``--api-key``, vLLM's ``--hf-token``) in an argv (a server
  started by hand, a refused flag in an error, a kept cluster's state file);
* the value of a secret environment variable (:data:`SECRET_ENV`) in an env mapping;
* the password in a URL (``http://user:pw@host`` -> ``http://user:***@host``), registered or not.

Secrets are process-wide (the settings register the API key, attach-URL passwords, the values of
:data:`SECRET_ENV` variables in the environment and of :data:`SECRET_FLAGS` in the extra args at configure
time: :func:`secrets_in`), so an error raised deep in the process code is redacted without threading the key through.
This module is pytest-free and imports only the standard library.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import unquote, urlsplit

__all__ = [
    "MASK", "SECRET_ENV", "SECRET_FLAGS", "redact", "redact_argv", "redact_env", "register", "secrets_in",
    "url_password",
]  # fmt: skip

MASK = "***"
#: Environment variables whose values are secrets (pdserve sets VLLM_API_KEY; the others are common tokens).
SECRET_ENV = frozenset({"VLLM_API_KEY", "OPENAI_API_KEY", "PDSERVE_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})
#: vLLM flags whose value is a secret (``--hf-token`` is ``EngineArgs.hf_token``: a token for gated models).
SECRET_FLAGS = ("--api-key", "--hf-token")
_SHORT = 8
_URL_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*:)(?P<pw>[^\s/@]+)@")
_secrets: set[str] = set()
_lock = threading.Lock()
_pattern: re.Pattern[str] | None = None


def register(*secrets: str | None) -> None:
    """Add secret values to hide from now on (None and empty strings are ignored)."""
    global _pattern
    with _lock:
        _secrets.update(s for s in secrets if s)
        _pattern = _compile(_secrets)


def _compile(secrets: Iterable[str]) -> re.Pattern[str] | None:
    alternatives = []
    for s in sorted(secrets, key=len, reverse=True):  # longest first: one secret may contain another
        escaped = re.escape(s)
        alternatives.append(escaped if len(s) >= _SHORT else rf"(?<![\w-]){escaped}(?![\w-])")
    return re.compile("|".join(alternatives)) if alternatives else None


def url_password(url: str) -> str | None:
    """The password in *url*'s userinfo, or None."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return unquote(password) if password else None


def redact(text: str) -> str:
    """*text* with every registered secret and every URL password replaced by ``***``."""
    text = _URL_USERINFO.sub(lambda m: f"{m.group('head')}{MASK}@", text)
    pattern = _pattern
    return pattern.sub(MASK, text) if pattern is not None else text


def redact_argv(argv: Sequence[str]) -> list[str]:
    """*argv* for a log header or an error: the value of a :data:`SECRET_FLAGS` flag hidden, then :func:`redact`."""
    out = []
    for i, arg in enumerate(argv):
        flag = arg.partition("=")[0]
        if i and argv[i - 1] in SECRET_FLAGS:
            out.append(MASK)
        elif flag in SECRET_FLAGS and "=" in arg:
            out.append(f"{flag}={MASK}")
        else:
            out.append(redact(arg))
    return out


def redact_env(env: Mapping[str, str | None]) -> dict[str, str | None]:
    """*env* with the values of :data:`SECRET_ENV` variables hidden, then :func:`redact` on the rest."""
    return {k: (MASK if k in SECRET_ENV and v else (redact(v) if isinstance(v, str) else v)) for k, v in env.items()}


def secrets_in(argv: Sequence[str] = (), env: Mapping[str, str | None] | None = None) -> list[str]:
    """The secret values an argv (after a :data:`SECRET_FLAGS` flag) and an env (:data:`SECRET_ENV`) carry,
    for :func:`register`: a server prints what it was given (vLLM's ``non-default args``), so a token a run
    hands its servers is hidden in their log excerpts and every message that quotes them."""
    found = [arg for prev, arg in zip(argv, argv[1:], strict=False) if prev in SECRET_FLAGS]
    found += [arg.partition("=")[2] for arg in argv if arg.partition("=")[0] in SECRET_FLAGS and "=" in arg]
    found += [v for k, v in (env or {}).items() if k in SECRET_ENV and v]
    return [s for s in found if s]
