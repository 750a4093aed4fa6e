"""Fixtures of the simulator tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ._simproc import Factory, sim_processes


@pytest.fixture
def sim_factory(tmp_path: Path) -> Iterator[Factory]:
    """Function-scoped :func:`sim_processes`."""
    with sim_processes(tmp_path) as start:
        yield start
