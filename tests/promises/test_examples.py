"""The example suite, run as users run it: a real pytest session over examples/, on each engine.

The simulator run is the README's first Quickstart command; the vLLM run is the real-vLLM tier
(`pytest examples --pd-engine=vllm`), skipped with a reason where vLLM is not installed.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
from _pdsession import GONE_WITHIN_S, MARK_ENV, live_procs, unheld_locks, wait_for

from pytest_pdserve import cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run_examples(pytester: pytest.Pytester, tmp_path: Path, engine: str, *extra: str) -> pytest.RunResult:
    if not (pytester.path / "examples").exists():
        shutil.copytree(EXAMPLES, pytester.path / "examples")
        pytester.makeini("[pytest]\naddopts = -p no:cacheprovider\n")
    return pytester.runpytest_subprocess(
        "examples", f"--pd-engine={engine}", f"--pd-lease-dir={tmp_path / 'leases'}",
        f"--pd-log-dir={tmp_path / 'logs'}", "-rs", *extra, timeout=1500,
    )  # fmt: skip


def test_examples_pass_on_the_simulator(pytester: pytest.Pytester, tmp_path: Path) -> None:
    result = _run_examples(pytester, tmp_path, "sim")
    # The long hybrid-Mamba prompt is skipped on the CPU platform on both engines (rules/mamba.py), as on real vLLM.
    result.assert_outcomes(passed=22, skipped=3)
    result.stdout.fnmatch_lines(["*SKIPPED*rocm*needs platform rocm*"])
    result.stdout.fnmatch_lines(["*SKIPPED*CPU Mamba kernel cannot prefix-cache a prompt of more than one block*"])


@pytest.mark.timeout(2400)  # the inner sessions start real P/D pairs on 2 cores: minutes, bounded by their own 1500 s
def test_examples_pass_on_real_vllm_twice_with_reuse(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, real_vllm: str
) -> None:
    """Issue 19's proof: the second `pytest examples --pd-engine=vllm --pd-reuse` attaches to every cluster the
    first one kept, passes the same tests, and `pdserve stop --all` leaves no process and no held lease."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK_ENV, mark)
    reuse_dir = tmp_path / "reuse"
    reuse = ("--pd-reuse", "--pd-reuse-mode=force", f"--pd-reuse-dir={reuse_dir}")  # force: CI sets CI
    try:
        first = _run_examples(pytester, tmp_path, "vllm", *reuse)
        # The long hybrid-Mamba prompt is skipped on CPU with the reason that names vLLM's CPU kernel limit.
        first.assert_outcomes(passed=22, skipped=3)
        first.stdout.fnmatch_lines(["*SKIPPED*CPU Mamba kernel cannot prefix-cache a prompt of more than one block*"])
        first.stdout.fnmatch_lines(["*pdserve: reuse: kept pd-1-*, hybrid-ssm-2-* for the next --pd-reuse run*"])
        second = _run_examples(pytester, tmp_path, "vllm", *reuse)
        # The fault examples need servers this run started: on the kept cluster they skip, saying so.
        second.assert_outcomes(passed=20, skipped=5)
        second.stdout.fnmatch_lines(["*SKIPPED*faults need servers this run started*"])
        second.stdout.fnmatch_lines(
            ["*cluster pd (vllm, 1P x 1D) reused kept cluster pd-1-*", "*cluster hybrid-ssm (vllm, 1P x 1D) reused*"]
        )
        out = second.stdout.str()
        assert out.count("reused kept cluster") == 3, "the second run started a cluster of its own"
        assert "starting a fresh cluster" not in out
        # Each kept vLLM server's IPC sockets live in its own directory (rpc_dirs.py), not loose in /tmp.
        rpc_dirs = [Path(s["rpc_dir"]) for p in reuse_dir.glob("*.json") for s in json.loads(p.read_text())["servers"]]
        assert len(rpc_dirs) == 6, rpc_dirs
        assert all(any(e.is_socket() for e in d.iterdir()) for d in rpc_dirs), rpc_dirs
    finally:
        assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    wait_for(lambda: not live_procs(mark), GONE_WITHIN_S, f"no process left ({live_procs(mark)})")
    unheld_locks(tmp_path / "leases")
    assert [d for d in rpc_dirs if d.exists()] == [], "a stopped server's IPC socket directory was left"
