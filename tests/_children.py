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


def as_a_terminal_job() -> None:
    """``preexec_fn`` for an inner pytest that a test Ctrl-Cs: :func:`die_with_parent`, and SIGINT back to its default.

    A shell that starts a job in the background (``.ci/run &``, a CI runner's non-interactive shell) sets SIGINT to
    ignored, every process below inherits that, and Python installs its KeyboardInterrupt handler only when SIGINT
    is not ignored: the inner pytest then sleeps through the Ctrl-C (test_ctrl_c_stops_servers_and_keeps_logs hung
    30 s, 2026-12-04). A terminal's foreground job has SIGINT at its default, which is what these tests are about.
    """
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
