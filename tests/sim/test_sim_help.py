"""``pdserve-sim --help`` and ``serve --help`` describe the flags and every environment knob."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from pytest_pdserve.sim import faults


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_pdserve.sim", *args], capture_output=True, text=True, timeout=60
    )


def test_top_level_help_names_the_command_and_the_fault_switches() -> None:
    out = _run("--help")
    assert out.returncode == 0
    assert "serve [model_tag] [options]" in out.stdout
    assert "PDSERVE_SIM_CRASH_AFTER_REQUESTS" in out.stdout
    assert _run().returncode == 2  # no command: usage on stderr


def test_serve_help_describes_flags_and_lists_every_knob_the_simulator_reads() -> None:
    out = _run("serve", "--help")
    assert out.returncode == 0
    assert "tokens per KV block" in out.stdout
    assert "--tokenizer DIR" in out.stdout
    read = set(re.findall(r'"((?:PDSERVE_SIM|VLLM)_[A-Z_]+)"', Path(faults.__file__).read_text()))
    assert read, "no environment variables found in faults.py"
    missing = sorted(name for name in read if name not in out.stdout)
    assert not missing, f"serve --help does not document {missing} (add them to pytest_pdserve/sim/__init__.py)"
