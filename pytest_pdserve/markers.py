"""Markers ``cuda``, ``rocm``, ``gpus(n)`` and vLLM's ``distributed(num_gpus=N)``, and the skips.

A test runs only when the session's inventory (see :func:`pytest_pdserve.settings.get_inventory`)
satisfies every such marker on it. Skip reasons say what is missing and what to change.
A malformed marker stops the run with a usage error listing each bad test and marker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pytest

from pytest_pdserve.inventory import Inventory
from pytest_pdserve.settings import get_inventory

__all__ = ["MARKERS", "Requirement", "apply_skips", "register_markers", "requirement_for", "skip_reason"]

MARKERS = (
    "cuda: run only on the CUDA platform (pytest-pdserve; see --pd-platform)",
    "rocm: run only on the ROCm platform (pytest-pdserve; see --pd-platform)",
    "gpus(n): needs at least n GPUs visible to pytest, else skipped (pytest-pdserve; "
    "--pd-simulate-gpus simulates them)",
    "distributed(num_gpus): run this test only in distributed GPU tests (vLLM's marker; "
    "pytest-pdserve skips it when fewer than num_gpus GPUs are visible)",
)
PLATFORM_MARKERS = ("cuda", "rocm")


class MarkerError(ValueError):
    """A marker has arguments that cannot be understood."""


@dataclass(frozen=True)
class Requirement:
    """What an item needs: a platform (any of, empty = any) and a GPU count."""

    platforms: frozenset[str] = frozenset()
    gpus: int = 0

    @property
    def trivial(self) -> bool:
        """True when the item needs nothing from the inventory."""
        return not self.platforms and self.gpus == 0


def register_markers(config: pytest.Config) -> None:
    """Register the markers so ``--strict-markers`` accepts them and ``pytest --markers`` lists them."""
    for line in MARKERS:
        config.addinivalue_line("markers", line)


_OUR_MARKERS = frozenset({*PLATFORM_MARKERS, "gpus", "distributed"})


def _count(value: object, marker: str, how: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MarkerError(f"{marker}: {how} must be a whole number >= 1, got {value!r}")
    return value


def requirement_for(item: pytest.Item) -> Requirement:
    """The combined requirement of *item*'s markers; raises :class:`MarkerError` for a bad one."""
    if not any(m.name in _OUR_MARKERS for m in item.iter_markers()):
        return Requirement()  # the common case, kept cheap: it runs for every collected item
    platforms = {name for name in PLATFORM_MARKERS if item.get_closest_marker(name) is not None}
    need = 0
    for mark in item.iter_markers("gpus"):
        shown = f"@pytest.mark.gpus{_call(mark.args, mark.kwargs)}"
        usage = "use @pytest.mark.gpus(2)"
        if len(mark.args) + len(mark.kwargs) != 1 or (mark.kwargs and "n" not in mark.kwargs):
            raise MarkerError(f"{shown}: takes exactly one GPU count; {usage}")
        value = mark.args[0] if mark.args else mark.kwargs["n"]
        try:
            need = max(need, _count(value, shown, "the GPU count"))
        except MarkerError as exc:
            raise MarkerError(f"{exc}; {usage}") from None
    for mark in item.iter_markers("distributed"):
        # vLLM writes distributed(num_gpus=N); a bare @distributed only labels the test.
        if "num_gpus" in mark.kwargs or mark.args:
            shown = f"@pytest.mark.distributed{_call(mark.args, mark.kwargs)}"
            value = mark.kwargs.get("num_gpus", mark.args[0] if mark.args else None)
            try:
                need = max(need, _count(value, shown, "num_gpus"))
            except MarkerError as exc:
                raise MarkerError(f"{exc}; use @pytest.mark.distributed(num_gpus=2)") from None
    return Requirement(frozenset(platforms), need)


def _call(args: Iterable[object], kwargs: Mapping[str, object]) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})"


def _how(inv: Inventory) -> str:
    return inv.source if inv.simulated or inv.platform == "cpu" else f"detected via {inv.source}"


def skip_reason(req: Requirement, inv: Inventory) -> str | None:
    """Why an item with *req* cannot run on *inv*, or None when it can."""
    if req.platforms and inv.platform not in req.platforms:
        wanted = " or ".join(sorted(req.platforms))
        return f"needs platform {wanted}, this machine is {inv.platform} ({_how(inv)})"
    if inv.count >= req.gpus or inv.platform == "cpu":
        # On a CPU-only machine pdserve's servers run on the CPU (the simulator, or vLLM's CPU backend), so a
        # GPU count does not apply; --pd-platform=cuda|rocm makes it apply (and skip) anyway.
        return None
    plural = "GPU" if req.gpus == 1 else "GPUs"
    reason = f"needs {req.gpus} {plural}, "
    reason += f"{inv.count} visible" if inv.count else "none visible"
    if inv.visibility:
        reason += f": {inv.visibility}"
    else:
        reason += f" ({inv.platform}, {_how(inv)})"
    if inv.note:
        reason += f" ({inv.note})"
    return reason


def apply_skips(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add skip markers to items whose platform / GPU markers the inventory cannot satisfy.

    The inventory is only waited for when some item carries one of the markers.
    """
    errors: list[str] = []
    needs: list[tuple[pytest.Item, Requirement]] = []
    for item in items:
        try:
            req = requirement_for(item)
        except MarkerError as exc:
            errors.append(f"  {item.nodeid}: {exc}")
            continue
        if not req.trivial:
            needs.append((item, req))
    if errors:
        raise pytest.UsageError("pdserve: bad marker arguments:\n" + "\n".join(errors))
    if not needs:
        return
    inv = get_inventory(config)
    for item, req in needs:
        reason = skip_reason(req, inv)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
