"""Stop a cluster once no remaining test will use it, as pytest tears a fixture down after its last user.

The clusters behind the session-scoped ``pd_cluster_factory`` used to stay up to the session's end: a user module
left five real vLLM servers (about 15 GB) up at once. Each cluster the fixtures hand out remembers who asked for it:

- a fixture (``pd_cluster`` itself, or a user's ``hybrid_cluster`` that calls the factory): the cluster is used by
  every remaining test whose fixture closure holds that fixture (with the same parameter, for a parametrised one);
- a test's own body (or a fixture a test fetched with ``request.getfixturevalue``): by every remaining test of the
  same module. What a body asks for is not known before it runs, so a module's end is the latest such a cluster
  stays up; a cluster several modules share is asked for from a fixture they request (in a conftest.py).

After each test (once its fixtures are torn down), a cluster none of whose askers has a remaining user is stopped.
The remaining tests are the collected items this process has not run yet; an xdist worker cannot tell which of
them it will be sent, nor in which order, so it keeps a cluster while any of them might use it (in practice, to the
session's end when other workers run its users).

On the CPU platform, before a real-vLLM cluster starts, every other real-vLLM cluster the running test does not use
is stopped first: a pair is ~6 GB of memory a small machine may not have twice. A later test that needs a stopped
cluster starts it again.

Neither in a ``--pd-reuse`` run (its clusters are kept up for the next run anyway) nor in attach mode, and never a
cluster something other than these fixtures asked for (``--pd-export-env``'s session cluster: ``manager.pinned``).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

from pytest_pdserve.config.settings import PDSERVE_CONFIG

if TYPE_CHECKING:
    from pytest_pdserve.cluster import PDCluster
    from pytest_pdserve.running.manager import ClusterManager
    from pytest_pdserve.spec import ClusterSpec  # a key type only: spec.py loads when a cluster is described

#: Engines whose clusters are not kept up side by side on CPU (~3 GB a server); tests add the simulator.
SIDE_BY_SIDE_ENGINES = frozenset({"vllm"})


class Asker(NamedTuple):
    """Who asked for a cluster: a fixture (``fixturedef``, with its parameter's index if parametrised), or the body
    of test ``nodeid`` in ``module`` (a nodeid).

    A NamedTuple, not a frozen dataclass: equal and hashable the same way, and cheaper to define, which every run
    pays when the plugin loads."""

    fixturedef: Any = None  # pytest's FixtureDef (not public API: compared by identity only)
    argname: str = ""
    param_index: int | None = None
    module: str = ""
    nodeid: str = ""


class _State:
    """The session's record of who asked for which cluster (a plain class: a dataclass costs more to define when the
    plugin loads)."""

    def __init__(self) -> None:
        #: The fixtures being set up now, innermost last: the last one is who calls the factory.
        self.setting_up: list[tuple[Any, int | None]] = []
        self.askers: dict[ClusterSpec, set[Asker]] = {}
        #: Position of a test not run yet known to use a spec (skips rescanning the items after every test).
        self.next_user: dict[ClusterSpec, int] = {}
        #: Positions of the items this process has run.
        self.done: set[int] = set()
        self.items: list[pytest.Item] = []
        #: id(item) -> index in items; built when a cluster first has askers (a run that starts none never needs it).
        self.position: dict[int, int] = {}


STATE = pytest.StashKey[_State]()


def _state(config: pytest.Config) -> _State:
    if STATE not in config.stash:
        config.stash[STATE] = _State()
    return config.stash[STATE]


def collection_finished(session: pytest.Session) -> None:
    """Remember the items in the order they run (pytest_collection_finish: after every reordering hook)."""
    state = _state(session.config)
    state.items = list(session.items)
    state.position = {}
    state.next_user.clear()
    state.done.clear()


def fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Generator[None, Any, Any]:
    """Wrap pytest_fixture_setup: while a fixture's code runs, it is who asks for any cluster it gets."""
    params = getattr(fixturedef, "params", None)
    index = getattr(request, "param_index", None) if params else None
    stack = _state(request.config).setting_up
    stack.append((fixturedef, index))
    try:
        return (yield)
    finally:
        stack.pop()


def current_asker(config: pytest.Config, item: pytest.Item | None) -> Asker | None:
    """Who is asking for a cluster now: the innermost fixture being set up, else the running test's body; None
    outside any test (then the cluster is never stopped early)."""
    stack = _state(config).setting_up
    if stack:
        fixturedef, index = stack[-1]
        return Asker(fixturedef=fixturedef, argname=str(getattr(fixturedef, "argname", "")), param_index=index)
    if item is None:
        return None
    return Asker(module=_module(item), nodeid=item.nodeid)


def note(
    config: pytest.Config, manager: ClusterManager, spec: ClusterSpec, asker: Asker | None, item: pytest.Item | None
) -> None:
    """``asker`` got the cluster for ``spec`` while ``item`` ran; an unknown asker (None) pins it up to the end."""
    state = _state(config)
    state.next_user.pop(spec, None)
    if asker is None:
        manager.pinned.add(spec)
        return
    askers = state.askers.setdefault(spec, set())
    askers.add(asker)
    if asker.fixturedef is not None and item is not None and not _uses(asker, item):
        # Fetched with request.getfixturevalue: what follows fetches it the same way unseen; its module may.
        askers.add(Asker(module=_module(item), nodeid=item.nodeid))


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _uses(asker: Asker, item: pytest.Item) -> bool:
    if asker.fixturedef is None:
        return _module(item) == asker.module
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}).get(asker.argname) if info is not None else None
    if defs is None:  # no closure to read (another item type): by name, the conservative answer
        if asker.argname not in getattr(item, "fixturenames", ()):
            return False
    elif not any(d is asker.fixturedef for d in defs):
        return False
    if asker.param_index is None:
        return True
    indices: dict[str, int] = getattr(getattr(item, "callspec", None), "indices", {})
    return indices.get(asker.argname, asker.param_index) == asker.param_index


def _applies(manager: ClusterManager, config: pytest.Config) -> bool:
    # Not in a forked child: its clusters are its parent's (common/owner.py), nor is a "stopping" line its to say.
    return manager.reuser is None and not config.stash[PDSERVE_CONFIG].attach_mode and manager.owner.here


def stop_unused(item: pytest.Item, manager: ClusterManager | None) -> None:
    """After ``item`` (its fixtures torn down): stop each cluster no remaining test uses."""
    state = _state(item.config)
    if manager is None or not state.askers or not _applies(manager, item.config):
        return
    if not state.position:
        state.position = {id(it): n for n, it in enumerate(state.items)}
    pos = state.position.get(id(item))
    if pos is None:  # not a collected item (a plugin re-running it): nothing known about what follows
        return
    state.done.add(pos)
    # Remaining = every collected item this process has not run yet, not only those after this one: an xdist
    # worker runs the files it is sent in the order they come, not in collection order (loadfile sent a later file
    # first, and a cluster an earlier file still needed was stopped).
    order = [*range(pos + 1, len(state.items)), *range(pos)]  # the nearest first: most searches end early
    for spec, askers in list(state.askers.items()):
        if not askers or spec in manager.pinned or not manager.is_running(spec):
            continue
        known = state.next_user.get(spec)
        if known is not None and known not in state.done:
            continue
        later = next((n for n in order if n not in state.done and any(_uses(a, state.items[n]) for a in askers)), None)
        if later is not None:
            state.next_user[spec] = later
            continue
        _stop(manager, spec, f"no remaining test uses it (its last user was {item.nodeid})")


def make_cpu_room(item: pytest.Item | None, manager: ClusterManager, spec: ClusterSpec) -> None:
    """Before a real-vLLM cluster for ``spec`` starts on CPU: stop the other real-vLLM clusters the running test
    does not use (two side by side need twice the memory; a later test that needs one starts it again)."""
    if item is None or not _applies(manager, item.config) or manager.inventory.platform != "cpu":
        return
    engine = spec.engine or manager.default_engine
    if engine not in SIDE_BY_SIDE_ENGINES or manager.is_running(spec):
        return
    state = _state(item.config)
    for cluster in manager.running():
        other = cluster.spec
        if cluster.engine not in SIDE_BY_SIDE_ENGINES or other in manager.pinned or not state.askers.get(other):
            continue
        if _holds(item, cluster, state.askers[other]):
            continue  # the running test holds it: both are needed
        _stop(manager, other, f"cluster {spec.name} ({engine}) starts next on CPU and {item.nodeid} does not "
                                      "use this one: two are not kept up side by side (a later user starts it "
                                      "again)")  # fmt: skip


def _holds(item: pytest.Item, cluster: PDCluster, askers: set[Asker]) -> bool:
    """Whether the running test uses ``cluster``: through a fixture it requests, its own body, or a value it got."""
    if any(a.nodeid == item.nodeid if a.fixturedef is None else _uses(a, item) for a in askers):
        return True
    values = list(getattr(item, "funcargs", {}).values())
    values += [v for d in values if isinstance(d, dict) for v in d.values()]
    return any(v is cluster for v in values)


def _stop(manager: ClusterManager, spec: ClusterSpec, why: str) -> None:
    """Stop through the manager, whose ``on_stop`` listeners make pytest forget the cached fixture value (one door
    for every early stop: glue/fixtures.py registers the listener before any cluster is handed out)."""
    name = next((c.spec.name for c in manager.running() if c.spec == spec), spec.name)  # name: not in spec's ==
    manager.report(f"pdserve: stopping cluster {name}: {why}")
    manager.stop(spec, why=why)
