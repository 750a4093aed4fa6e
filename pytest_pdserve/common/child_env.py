"""The environment of every process pdserve starts: one rule, here. [pytest-free, stdlib only: the keeper imports it
under ``python -I -S`` to start its guard]

Every child (the servers and the proxy, the watchdog, the guard, the keeper, the probes it runs: ``nvidia-smi``,
``vllm --version``, the tiny model's build) gets :func:`child_environ`: this process's environment as it is *now*,
with the caller's changes, and without what must not reach a child:

* ``PYTEST_CURRENT_TEST``: pytest's name of the test that happens to run while the child starts. It describes
  this process, not the child, and a test id has no length limit (a parametrised id of 150,000 characters made
  Linux refuse to start the watchdog: ``E2BIG``, "Argument list too long");
* the caller's ``drop`` names (the run and server tokens: a sweep by token must never hit a helper);
* a variable Linux cannot hand to a program: one ``NAME=value`` string over :data:`MAX_ARG_STRLEN` bytes, or an
  environment past the kernel's total (``ARG_MAX``). The helpers read none of the user's variables, so for them
  such a variable is left out (``oversize="drop"``); the servers might read it, so for them it is an error naming
  the variable and its size (``oversize="refuse"``, :class:`EnvTooLarge`), never a silent change and never a bare
  ``OSError: [Errno 7]`` from deep inside ``subprocess``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Literal

from pytest_pdserve.errors import EnvTooLarge

__all__ = [
    "MAX_ARG_STRLEN",
    "NOT_INHERITED",
    "EnvTooLarge",
    "child_environ",
    "enter_session",
    "leave_session",
    "start_dir",
]

#: Linux's limit on one argv or environment string, its NUL included (``MAX_ARG_STRLEN``: 32 pages of 4 KiB).
MAX_ARG_STRLEN = 32 * 4096
#: Variables of this process that no child inherits (see the module docstring).
NOT_INHERITED = ("PYTEST_CURRENT_TEST",)
#: Kept free of the kernel's total for the child's argv and what the loader adds.
_ARGV_ROOM = 256 * 1024


def _entry_size(key: str, value: str) -> int:
    """Bytes of ``KEY=value\\0`` as the kernel counts them (file-system encoding, as ``subprocess`` encodes)."""
    try:
        return len(os.fsencode(key)) + len(os.fsencode(value)) + 2
    except UnicodeError:  # not encodable here at all (the locale): subprocess says so itself
        return len(key.encode(errors="surrogatepass")) + len(value.encode(errors="surrogatepass")) + 2


def _arg_max() -> int:
    try:
        return int(os.sysconf("SC_ARG_MAX"))
    except (ValueError, OSError):
        return 2 * 1024 * 1024


def child_environ(
    delta: Mapping[str, str | None] | None = None,
    *,
    drop: Iterable[str] = (),
    oversize: Literal["drop", "refuse"] = "drop",
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """This process's environment now (or ``base``, a copy the caller took for a cluster's start), for a child:
    ``delta`` applied (``None`` removes a variable), without :data:`NOT_INHERITED` and ``drop``, and without what
    Linux cannot pass (see the module docstring).

    :param oversize: ``"drop"`` leaves out each variable the kernel would refuse, the largest first while the
        total is too large (helpers); ``"refuse"`` raises instead (servers).
    :raises EnvTooLarge: with ``oversize="refuse"``, naming the variable and its size and the limit.
    """
    env = dict(os.environ if base is None else base)
    for key, value in (delta or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    for key in (*NOT_INHERITED, *drop):
        env.pop(key, None)
    sizes = {key: _entry_size(key, value) for key, value in env.items()}
    for key, size in sizes.items():
        if size > MAX_ARG_STRLEN:
            if oversize == "refuse":
                raise EnvTooLarge(
                    f"environment variable {key} is {size - 2 - len(key):,} bytes long: Linux passes at most "
                    f"{MAX_ARG_STRLEN - 2 - len(key):,} bytes per variable to a program (MAX_ARG_STRLEN), so no "
                    f"server can be started with it; unset it or make it shorter"
                )
            del env[key]
    budget = _arg_max() - _ARGV_ROOM
    total = sum(sizes[key] for key in env)
    if total > budget:
        if oversize == "refuse":
            largest = sorted(env, key=lambda k: -sizes[k])[:3]
            raise EnvTooLarge(
                f"the environment is {total:,} bytes: more than Linux passes to a program ({budget:,} with room for "
                f"the arguments); the largest variables are {', '.join(largest)}"
            )
        for key in sorted(env, key=lambda k: -sizes[k]):
            if total <= budget:
                break
            total -= sizes[key]
            del env[key]
    return env


#: The directories the pytest sessions of this process were started in, the innermost last (an in-process pytester
#: session adds its own and removes it at its end).
_start_dirs: list[str] = []


def enter_session(path: str | os.PathLike[str]) -> None:
    """``pytest_configure``: pytest was started in ``path`` (``config.invocation_params.dir``)."""
    _start_dirs.append(os.fspath(path))


def leave_session(path: str | os.PathLike[str]) -> None:
    """``pytest_unconfigure``: that session is over."""
    where = os.fspath(path)
    if where in _start_dirs:
        del _start_dirs[len(_start_dirs) - 1 - _start_dirs[::-1].index(where)]


def start_dir() -> str | None:
    """The working directory of every server and proxy pdserve starts: the one pytest was started in, whatever a
    test's ``os.chdir`` / ``monkeypatch.chdir`` made the current one since. A relative path the user gave
    (``--pd-proxy-command "{python} toy_proxy_server.py ..."``, ``--pd-model ./model``, ``--pd-vllm-executable``)
    was checked there at start-up, and means the same at every start. None (inherit) outside a pytest session, or
    when that directory is gone."""
    if _start_dirs and os.path.isdir(_start_dirs[-1]):
        return _start_dirs[-1]
    return None
