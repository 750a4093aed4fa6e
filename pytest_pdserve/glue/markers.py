"""Markers ``cuda``, ``rocm``, ``gpus(n)`` and vLLM's ``distributed(num_gpus=N)``, and the skips.

A test runs only when the session's inventory (see :func:`pytest_pdserve.glue.session_inventory.get_inventory`)
satisfies every such marker on it. Skip reasons say what is missing and what to change.
A malformed marker (a bad value, a missing or unknown argument, keyword names included) stops the run
at collection with a usage error listing each bad test and marker.

On a CPU-only machine a GPU count applies only to tests that use no pd fixture (they do their own GPU
work, like vLLM's ``test_accuracy_rocm.py``, and are skipped); tests that use ``pd_cluster`` /
``pd_cluster_factory`` run on the CPU engine, and their report carries a ``pdserve`` section saying so
(shown by ``-rA``). Under ``--pd-share-gpus`` such a test needs one GPU, whatever its count: every server of
its cluster runs on that one GPU (its report says so too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

from pytest_pdserve.config.settings import PDSERVE_CONFIG
from pytest_pdserve.errors import MarkerError
from pytest_pdserve.glue import worker_verdict
from pytest_pdserve.glue.session_inventory import get_inventory

if TYPE_CHECKING:
    from pytest_pdserve.machine.inventory import Inventory

__all__ = [
    "MARKERS",
    "PD_FIXTURES",
    "Requirement",
    "apply_skips",
    "cpu_note",
    "register_markers",
    "requirement_for",
    "shared_gpu_need",
    "skip_reason",
]

MARKERS = (
    "cuda: run only on the CUDA platform (pytest-pdserve; see --pd-platform)",
    "rocm: run only on the ROCm platform (pytest-pdserve; see --pd-platform)",
    "gpus(n): needs at least n GPUs visible to pytest, else skipped (pytest-pdserve; "
    "--pd-simulate-gpus simulates them)",
    "distributed(num_gpus): run this test only in distributed GPU tests (vLLM's marker; "
    "pytest-pdserve skips it when fewer than num_gpus GPUs are visible)",
)
PLATFORM_MARKERS = ("cuda", "rocm")


class Requirement(NamedTuple):
    """What an item needs: a platform (any of, empty = any) and a GPU count.

    A NamedTuple, not a frozen dataclass: cheaper to define, which every run pays when the plugin loads."""

    platforms: frozenset[str] = frozenset()
    gpus: int = 0
    #: The item uses a pd fixture, so on a CPU-only machine its cluster runs on the CPU engine instead.
    uses_cluster: bool = True
    #: The markers as written, for the -rA note (``gpus(2)``).
    shown: tuple[str, ...] = ()

    @property
    def trivial(self) -> bool:
        """True when the item needs nothing from the inventory."""
        return not self.platforms and self.gpus == 0


def register_markers(config: pytest.Config) -> None:
    """Register the markers so ``--strict-markers`` accepts them and ``pytest --markers`` lists them."""
    for line in MARKERS:
        config.addinivalue_line("markers", line)


_OUR_MARKERS = frozenset({*PLATFORM_MARKERS, "gpus", "distributed"})
#: The fixtures that give a test a cluster the plugin starts (directly or through another fixture).
PD_FIXTURES = frozenset({"pd_cluster", "pd_cluster_factory"})
_MAX_GPUS = 4096


def _count(value: object, marker: str, how: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MarkerError(f"{marker}: {how} must be a whole number >= 1, got {value!r}")
    if value > _MAX_GPUS:
        raise MarkerError(f"{marker}: {how} must be at most {_MAX_GPUS}, got {value!r}")
    return value


def _unknown(kwargs: Mapping[str, object], known: Iterable[str], shown: str, usage: str) -> None:
    extra = sorted(set(kwargs) - set(known))
    if extra:
        names = ", ".join(extra)
        raise MarkerError(f"{shown}: unknown keyword argument{'s' if len(extra) > 1 else ''} {names}; {usage}")


_NO_REQUIREMENT = Requirement()


def _marked(node: Any, parents: dict[int, bool]) -> bool:
    """Whether *node* (an item or a collector: ``Any``, pytest's Node type is not public API) or a node above it
    carries one of our markers (what ``iter_markers`` would find); *parents* caches the answer per parent node, so
    2,000 items of 20 modules walk 20 chains, not 2,000."""
    for mark in node.own_markers:
        if mark.name in _OUR_MARKERS:
            return True
    parent = node.parent
    if parent is None:
        return False
    known = parents.get(id(parent))
    if known is None:
        known = parents[id(parent)] = _marked(parent, parents)
    return known


def requirement_for(item: pytest.Item, parents: dict[int, bool] | None = None) -> Requirement:
    """The combined requirement of *item*'s markers; raises :class:`MarkerError` for a bad one.

    :param parents: a cache shared across the items of one collection (see :func:`_marked`).
    """
    if not _marked(item, {} if parents is None else parents):
        return _NO_REQUIREMENT  # the common case, kept cheap: it runs for every collected item
    platforms = {name for name in PLATFORM_MARKERS if item.get_closest_marker(name) is not None}
    for name in PLATFORM_MARKERS:
        for mark in item.iter_markers(name):
            if mark.args or mark.kwargs:
                raise MarkerError(f"@pytest.mark.{name}{_call(mark.args, mark.kwargs)}: takes no arguments; "
                                  f"use @pytest.mark.{name}")  # fmt: skip
    need = 0
    written: list[str] = []
    for mark in item.iter_markers("gpus"):
        shown = f"@pytest.mark.gpus{_call(mark.args, mark.kwargs)}"
        usage = "use @pytest.mark.gpus(2)"
        _unknown(mark.kwargs, ("n",), shown, f"gpus takes one GPU count, n; {usage}")
        if len(mark.args) + len(mark.kwargs) != 1:
            raise MarkerError(f"{shown}: takes exactly one GPU count; {usage}")
        written.append(shown.removeprefix("@pytest.mark."))
        value = mark.args[0] if mark.args else mark.kwargs["n"]
        try:
            need = max(need, _count(value, shown, "the GPU count"))
        except MarkerError as exc:
            raise MarkerError(f"{exc}; {usage}") from None
    for mark in item.iter_markers("distributed"):
        # vLLM writes distributed(num_gpus=N); a bare @distributed only labels the test.
        shown = f"@pytest.mark.distributed{_call(mark.args, mark.kwargs)}"
        usage = "use @pytest.mark.distributed(num_gpus=2)"
        _unknown(mark.kwargs, ("num_gpus",), shown, f"distributed takes num_gpus; {usage}")
        if len(mark.args) + len(mark.kwargs) > 1:
            raise MarkerError(f"{shown}: takes one GPU count, num_gpus; {usage}")
        if "num_gpus" in mark.kwargs or mark.args:
            written.append(shown.removeprefix("@pytest.mark."))
            value = mark.kwargs.get("num_gpus", mark.args[0] if mark.args else None)
            try:
                need = max(need, _count(value, shown, "num_gpus"))
            except MarkerError as exc:
                raise MarkerError(f"{exc}; use @pytest.mark.distributed(num_gpus=2)") from None
    uses_cluster = not PD_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
    return Requirement(frozenset(platforms), need, uses_cluster, tuple(written))


def _call(args: Iterable[object], kwargs: Mapping[str, object]) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})"


def _how(inv: Inventory) -> str:
    return inv.source if inv.simulated or inv.platform == "cpu" else f"detected via {inv.source}"


def shared_gpu_need(req: Requirement, share_gpus: bool) -> int:
    """The GPUs *req* needs from the inventory: under ``--pd-share-gpus`` a test whose GPUs are its pd cluster's
    needs one, since every server of that cluster runs on one GPU (a ``gpus(2)`` P/D test runs on one H200)."""
    return min(req.gpus, 1) if share_gpus and req.uses_cluster else req.gpus


def skip_reason(req: Requirement, inv: Inventory, *, share_gpus: bool = False) -> str | None:
    """Why an item with *req* cannot run on *inv*, or None when it can."""
    if share_gpus and req.uses_cluster and req.gpus > 1:
        req = req._replace(gpus=shared_gpu_need(req, share_gpus))
    if req.platforms and inv.platform not in req.platforms:
        wanted = " or ".join(sorted(req.platforms))
        return f"needs platform {wanted}, this machine is {inv.platform} ({_how(inv)})"
    if inv.count >= req.gpus or (inv.platform == "cpu" and req.uses_cluster):
        # On a CPU-only machine pdserve's servers run on the CPU (the simulator, or vLLM's CPU backend), so a
        # GPU count does not apply to a test that only uses them (cpu_note says so in its report);
        # --pd-platform=cuda|rocm makes it apply (and skip) anyway.
        return None
    plural = "GPU" if req.gpus == 1 else "GPUs"
    if inv.platform == "cpu":
        return (f"needs {req.gpus} {plural}, this machine has none ({_how(inv)}); it uses no pd fixture, so "
                "the CPU engine cannot stand in for them")  # fmt: skip
    reason = f"needs {req.gpus} {plural}, "
    reason += f"{inv.count} visible" if inv.count else "none visible"
    if inv.visibility:
        reason += f": {inv.visibility}"
    else:
        reason += f" ({inv.platform}, {_how(inv)})"
    if inv.note:
        reason += f" ({inv.note})"
    return reason


def cpu_note(req: Requirement, inv: Inventory, *, share_gpus: bool = False) -> str | None:
    """Why a GPU-count marker was not enforced as written, for a test that uses a pd fixture, or None: on a
    CPU-only machine its cluster runs on the CPU engine; under ``--pd-share-gpus`` it needs one GPU."""
    if req.gpus == 0 or not req.uses_cluster or inv.count >= req.gpus:
        return None
    if inv.platform == "cpu":
        return (f"{', '.join(req.shown)} not enforced: this machine is CPU-only ({_how(inv)}), so the pd cluster "
                "runs on the CPU engine; --pd-platform=cuda or rocm makes GPU counts apply")  # fmt: skip
    if shared_gpu_need(req, share_gpus) < req.gpus:
        return (f"{', '.join(req.shown)} counted as 1 GPU: --pd-share-gpus runs every server of the test's pd "
                f"cluster on one GPU ({inv.count} visible)")  # fmt: skip
    return None


def apply_skips(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add skip markers to items whose platform / GPU markers the inventory cannot satisfy.

    The inventory is only waited for when some item carries one of the markers.
    """
    errors: list[str] = []
    needs: list[tuple[pytest.Item, Requirement]] = []
    parents: dict[int, bool] = {}
    for item in items:
        if not _marked(item, parents):
            continue  # no marker of ours (the common case): nothing to check, no Requirement to build
        try:
            req = requirement_for(item, parents)
        except MarkerError as exc:
            errors.append(f"  {item.nodeid}: {exc}")
            continue
        if not req.trivial:
            needs.append((item, req))
    if errors:
        message = "pdserve: bad marker arguments:\n" + "\n".join(errors)
        if worker_verdict.stop(config, message, pytest.ExitCode.USAGE_ERROR):  # an xdist worker: the controller says it
            items.clear()
            return
        raise pytest.UsageError(message)
    if not needs:
        return
    inv = get_inventory(config)
    share = config.stash[PDSERVE_CONFIG].share_gpus if PDSERVE_CONFIG in config.stash else False
    for item, req in needs:
        reason = skip_reason(req, inv, share_gpus=share)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif (note := cpu_note(req, inv, share_gpus=share)) is not None:
            # A report section reaches every phase's report, so -rA (and JUnit XML) show it.
            item.add_report_section("setup", "pdserve", note)
