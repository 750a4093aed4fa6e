"""The environment a cluster starts with: one copy, taken when its start is decided. [pytest-free]

pytest's environment is not fixed once the plugin configured: a ``conftest.py`` in a sub-directory is imported
during collection, a fixture or ``monkeypatch.setenv`` runs before it asks for a cluster, a later plugin's
``pytest_configure`` sets what it likes. The rule (issue 43, class 2): **what is checked and fingerprinted is what
the servers get.** When the manager decides to start a cluster (or to attach, or to adopt a kept one) it calls
:func:`start_environ` once, and everything about that cluster comes from that one copy:

* the refusals: a variable read at configure that would now resolve differently (``settings.env_drift``: the
  settings were resolved from the old value, so the header, the servers' flags and a kept cluster's fingerprint
  would disagree with what the servers inherit), and a ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` that races the plugin's
  clients (``config/bounds.py``; refused at configure too, and in ``ClusterSpec.env``);
* a kept cluster's fingerprint (``reuse/fingerprint.py``: the ``env.*`` components);
* each server's and the proxy's environment (``launch.child_env`` applies a server's delta to this copy).

Nothing reads ``os.environ`` later for that cluster. A variable the settings do not read (``VLLM_*``, ``UCX_*``,
``HF_*``, ...) is honoured as it is at that moment: the servers get it, the fingerprint records it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from pytest_pdserve.config.bounds import server_keepalive_problem
from pytest_pdserve.errors import EnvironmentRefused

__all__ = ["Drift", "start_environ"]

#: ``settings.env_drift`` bound to the session's configuration: what changed since configure, in words, or None.
Drift = Callable[[Mapping[str, str]], str | None]


def start_environ(drift: Drift | None, *, own_servers: bool) -> dict[str, str]:
    """A copy of this process's environment for one cluster start, checked; every server inherits exactly it.

    :param drift: what changed since configure (None: nothing is held, e.g. a manager built outside pytest).
    :param own_servers: servers pdserve starts (not attach mode's, which are someone else's): the keep-alive rule.
    :raises EnvironmentRefused: naming each variable and why.
    """
    environ = dict(os.environ)
    problems = []
    if drift is not None and (changed := drift(environ)) is not None:
        problems.append(changed)
    if own_servers and (keepalive := server_keepalive_problem(environ)) is not None:
        problems.append(f"{keepalive} (in the environment the servers would inherit, as it is now)")
    if problems:
        raise EnvironmentRefused(f"pdserve: a cluster cannot start: {'; and '.join(problems)}")
    return environ
