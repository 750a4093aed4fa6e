"""pytest-timeout and the plugin's clusters: a test's timer is paused while a cluster starts or the plugin stops one
(pytest-timeout #96: a session fixture's setup and teardown are billed to whichever test runs first or last).

Only pytest-timeout's public hooks are used: this module observes them (the plugin registers its two hook
implementations) and calls them to cancel and re-arm a test's timer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

#: The settings pytest-timeout armed the current test's timer with (seen through its public hooks, below).
TIMEOUT_ARMED = pytest.StashKey[Any]()


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Observe (not handle: returns None) pytest-timeout arming a test's timer, to re-arm it after a pause."""
    item.stash[TIMEOUT_ARMED] = settings


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    """Observe pytest-timeout's timer being cancelled."""
    with contextlib.suppress(KeyError):
        del item.stash[TIMEOUT_ARMED]


@contextlib.contextmanager
def timeout_paused(item: pytest.Item | None) -> Iterator[None]:
    """Keep pytest-timeout's clock off while a cluster starts or the plugin stops one: the start has its own
    --pd-startup-timeout, the stop its --pd-shutdown-timeout.

    Otherwise a session-scoped start is billed to whichever test first asks for the cluster
    (pytest-timeout #96). The test's timer is re-armed, in full, once the cluster is up. Only pytest-timeout's
    public hooks are used: the settings are those it armed the timer with (none when ``func_only`` defers the
    timer to the test call, where no cluster starts).
    """
    settings = item.stash.get(TIMEOUT_ARMED, None) if item is not None else None
    if item is None or settings is None:
        yield
        return
    hook = item.config.pluginmanager.hook
    hook.pytest_timeout_cancel_timer(item=item)
    try:
        yield
    finally:
        hook.pytest_timeout_set_timer(item=item, settings=settings)
