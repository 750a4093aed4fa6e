"""How the simulator's and the proxy's processes import their server stack: without the cyclic garbage collector,
and httpx without its command-line client.

Importing starlette, uvicorn, pydantic and prometheus_client creates hundreds of thousands of objects that live as
long as the process, and the collector walks them again and again while they are made: with it off until the
imports are done, a simulator's import takes less CPU (a test run starts hundreds of these processes).
``gc.freeze`` then moves those objects out of every later collection. The collector is on again for everything the
server does.

httpx's ``__init__`` imports its command-line client (``httpx._main``: rich, click and pygments)
whenever those are installed, and falls back to a stub when that import fails; the proxy never runs it, so it
imports httpx with that module marked absent.
[pytest-free, stdlib]
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

__all__ = ["import_httpx_without_its_cli", "importing_without_gc"]


@contextlib.contextmanager
def importing_without_gc() -> Iterator[None]:
    """Inside: the collector off (unless it was off already). After: what was made is frozen, the collector back."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def import_httpx_without_its_cli() -> None:
    """Import httpx, skipping its command-line client; an httpx that cannot do without it is imported whole."""
    if "httpx" in sys.modules:
        return
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]  # None means "import fails", by the spec
    try:
        import httpx  # noqa: F401  # here, not at the top: the stub above must be in place first
    except ImportError:
        # A later httpx whose __init__ needs its client: forget the half-import and take httpx as it is.
        for name in [m for m in sys.modules if m == "httpx" or m.startswith("httpx.")]:
            del sys.modules[name]
        import httpx  # noqa: F401  # the retry, without the stub
