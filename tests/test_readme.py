"""The README's promises that code can check: the options table and the Quickstart commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_pdserve._options_table import BEGIN, END, render
from pytest_pdserve.setting_table import SETTINGS

README = Path(__file__).resolve().parent.parent / "README.md"


def test_options_table_is_generated_from_the_settings() -> None:
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == render(), "README options table is stale: run python -m pytest_pdserve._options_table"


def test_every_setting_is_in_the_table() -> None:
    table = render()
    for s in SETTINGS:
        assert f"`{s.flag}`" in table
        assert f"`{s.env_var}`" in table
        assert f"`{s.ini_key}`" in table


def test_quickstart_commands_exist() -> None:
    text = README.read_text()
    quickstart = text[text.index("## Quickstart") :]
    quickstart = quickstart[: quickstart.index("\n## ", 5)]
    assert "pytest examples --pd-engine=sim" in quickstart
    assert "bash .ci/run" in quickstart
    ci = (README.parent / ".ci" / "run").read_text()
    assert ".venv/bin/python -m pytest -p no:cacheprovider" in ci


def test_readme_example_test_passes_on_the_simulator(pytester: pytest.Pytester, tmp_path: Path) -> None:
    text = README.read_text()
    section = text[text.index("## A test, as a vLLM author writes it") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("\n```", start)]
    pytester.makepyfile(test_pd=code)
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={tmp_path / 'leases'}", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=2)
