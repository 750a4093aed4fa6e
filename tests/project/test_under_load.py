"""scripts/under-load.sh (README "Development"): a command beside busy processes, which end with it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "under-load.sh"

#: Counts the live busy loops of the script that started it (their $0 names the script's pid, its parent's), once
#: they are all there (each is started in the background: awaited, bounded, not assumed).
COUNT = """
import os, time
from pathlib import Path
mark = f"under-load-hog-{os.getppid()}".encode()
deadline = time.monotonic() + 60
while True:
    n = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _live(p) and mark in _cmdline(p))
    if n >= 2 or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print(n)
"""
HELPERS = """
def _cmdline(p):
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""

def _live(p):
    try:
        return (p / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
"""


def _live_hogs(script_pid: int) -> list[str]:
    mark = f"under-load-hog-{script_pid}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark in (proc / "cmdline").read_bytes():
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    found.append(proc.name)
        except OSError:
            continue
    return found


def test_the_command_runs_beside_the_busy_loops_which_end_with_it() -> None:
    run = subprocess.Popen(
        ["bash", str(SCRIPT), "-n", "2", sys.executable, "-c", HELPERS + COUNT], stdout=subprocess.PIPE, text=True
    )
    out, _ = run.communicate(timeout=60)
    assert run.returncode == 0
    assert out.split() == ["2"], out  # both loops were running beside the command
    deadline = time.monotonic() + 30  # and none outlives it: each was sent its SIGTERM, and dies when it runs next
    while _live_hogs(run.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_hogs(run.pid) == []


def test_the_commands_exit_status_is_kept() -> None:
    assert subprocess.run(["bash", str(SCRIPT), "-n", "1", "sh", "-c", "exit 7"], timeout=60).returncode == 7


def test_a_bad_count_is_refused() -> None:
    run = subprocess.run(["bash", str(SCRIPT), "-n", "many", "true"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "-n wants a number of busy processes, not 'many'" in run.stderr
