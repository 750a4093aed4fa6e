"""``--pd-reuse``'s layout promises (docs/architecture.md, "reuse/"): the kept state's one schema refuses another
version; launch and the manager import nothing of reuse; the reuse plugin is registered only when asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_pdserve.reuse import client, dirs
from pytest_pdserve.reuse.state import SCHEMA_VERSION, parse_state
from pytest_pdserve.running.proctree import read_stat

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")


def _state(**extra: object) -> dict[str, object]:
    me = read_stat(os.getpid())
    assert me is not None
    server = {"pid": os.getpid(), "pgid": os.getpgid(0), "starttime": me.starttime, "token": "nothing-carries-it",
              "url": "http://127.0.0.1:9", "name": "prefill-0", "role": "prefill", "index": 0}  # fmt: skip
    keeper = {"pid": os.getpid(), "starttime": me.starttime, "socket": "nobody", "ttl": 900, "since": 0}
    return {"id": "s-1", "spec_name": "pd", "created": 0, "fingerprint": {}, "servers": [server],
            "proxy": {**server, "name": "proxy", "role": "proxy"}, "keeper": keeper, **extra}  # fmt: skip


def test_a_state_file_of_another_schema_version_is_named_and_left_to_it(tmp_path: Path) -> None:
    """Another pdserve version's state file (another schema) is not listed and not removed: it is that version's
    (common/created.py: pdserve removes only what it can prove it created, and this version did not write it)."""
    assert parse_state(_state()).schema == SCHEMA_VERSION  # a file from before the field: version 1
    assert parse_state(_state(schema=SCHEMA_VERSION)).as_dict()["schema"] == SCHEMA_VERSION
    reuse_dir = dirs.ensure_reuse_dir(tmp_path / "reuse")
    (reuse_dir / "s-1.json").write_text(json.dumps(_state(schema=SCHEMA_VERSION + 1)))
    said: list[str] = []
    assert client.list_kept(reuse_dir, report=said.append) == []
    assert (reuse_dir / "s-1.json").exists()
    assert any(f"schema version {SCHEMA_VERSION + 1}, not {SCHEMA_VERSION}" in line for line in said), said


def test_launch_and_the_manager_import_nothing_of_reuse() -> None:
    """Nor does the main plugin: a run without --pd-reuse loads no module of reuse/ (fixtures.py reads only the
    plugin's name from the package, which is empty on purpose)."""
    probe = (
        "import sys, pytest_pdserve.running.launch, pytest_pdserve.running.manager, pytest_pdserve.plugin\n"
        "print(sorted(m for m in sys.modules if m.startswith('pytest_pdserve.reuse.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out


def test_the_reuse_plugin_is_registered_only_when_asked_for(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_nothing(): pass")
    plain = pytester.runpytest_subprocess("--trace-config", "--co", "-p", "no:cacheprovider")
    assert "ReusePlugin" not in plain.stdout.str()
    asked = pytester.runpytest_subprocess(
        "--trace-config", "--co", "-p", "no:cacheprovider", "--pd-reuse", f"--pd-reuse-dir={pytester.path / 'r'}"
    )
    asked.stdout.fnmatch_lines(["*PLUGIN registered: <pytest_pdserve.reuse.plugin.ReusePlugin object*"])
