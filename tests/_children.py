"""Processes a test starts itself die with the test process, however it ends.

Tests start their own servers and sessions in new sessions (``start_new_session=True``) so that a SIGKILL of the
group takes the whole tree; a fixture's ``finally`` kills them. But a test process that is itself killed (CI's
timeout, a developer's Ctrl-C twice, ``kill`` of the outer pytest) runs no ``finally``: the simulators of
``tests/sim/test_sim_start_rules.py`` were found still serving after the outer pytest had been SIGTERMed. The
kernel's parent-death signal does not depend on the dying process doing anything.

Pass :func:`die_with_parent` as ``preexec_fn``. It fires when the *thread* that started the child exits, so only
for children started from the test's own thread (every call site here is).
"""

from __future__ import annotations

import ctypes
import signal

# Resolved here, in the parent: after fork() the child may not import or load anything (another thread of the
# parent may have held the import lock at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: SIGKILL this child when the thread that started it exits."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
