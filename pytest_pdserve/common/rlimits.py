"""Raise the soft open-files limit to the hard one, as vLLM does at start (issue 25 class 6).

vLLM's ``set_ulimit`` (``vllm/utils/system_utils.py``) lifts its soft ``RLIMIT_NOFILE``; the proxy and the
simulator did not, so 1000 concurrent requests through the proxy at the common soft limit of 1024 were answered
969 times with 502 "ConnectError". Both call :func:`raise_nofile_limit` before they serve. Pytest-free, stdlib only.
"""

from __future__ import annotations

import resource

#: Where the soft limit goes when the hard limit is unlimited (Linux refuses RLIM_INFINITY above fs.nr_open).
UNLIMITED_TARGET = 1 << 20


def raise_nofile_limit() -> int:
    """Lift the soft ``RLIMIT_NOFILE`` to the hard limit (or :data:`UNLIMITED_TARGET`); returns the soft limit now.

    Never raises: a limit the kernel will not raise stays where it was (the caller's pool bound still holds).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
        return target
    return soft
