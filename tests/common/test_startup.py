"""common/startup.py: the server stack imported without the cyclic collector, which is then back as it was, and
httpx without its command-line client."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_pdserve.common.startup import importing_without_gc


@pytest.fixture
def gc_restored() -> Iterator[None]:
    was_on = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was_on else gc.disable)()


@pytest.mark.usefixtures("gc_restored")
def test_the_collector_is_off_inside_and_back_on_after() -> None:
    gc.enable()
    with importing_without_gc():
        assert not gc.isenabled()
        made: list[list[int]] = [[] for _ in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)  # what the imports made is out of later collections


@pytest.mark.usefixtures("gc_restored")
def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with importing_without_gc():
        pass
    assert not gc.isenabled()


@pytest.mark.usefixtures("gc_restored")
def test_the_simulator_serves_with_the_collector_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its entry point imports the server stack without it and turns it back on before serving: a long-running
    server without it would keep every reference cycle it makes."""
    import pytest_pdserve.sim.server as server
    from pytest_pdserve.sim.__main__ import main

    gc.enable()
    seen: list[bool] = []

    def serve(args: object, env: object) -> int:
        seen.append(gc.isenabled())
        return 0

    monkeypatch.setattr(server, "serve", serve)
    assert main(["serve", "pdserve-sim/tiny-llama", "--port", "8000"]) == 0
    assert seen == [True]


def test_the_proxy_serves_with_the_collector_on() -> None:
    code = (
        "import gc, runpy, sys\n"
        "sys.argv = ['proxy', '--help']\n"
        "try:\n    runpy.run_module('pytest_pdserve.proxy', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('gc', gc.isenabled(), gc.get_freeze_count() > 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip().endswith("gc True True")


def _proxy_help_then(probe: str) -> str:
    """What ``probe`` prints in a process that ran ``python -m pytest_pdserve.proxy --help`` (its imports, no serve)."""
    code = (
        "import gc, runpy, sys\n"
        "sys.argv = ['proxy', '--help']\n"
        "try:\n    runpy.run_module('pytest_pdserve.proxy', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        f"{probe}\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout


def test_the_proxy_imports_httpx_without_its_command_line_client() -> None:
    """httpx's client pulls in rich and pygments (~45 ms of CPU per proxy start); the proxy never runs it. Its
    package must not import the server stack before ``__main__`` does (it did, so neither this nor the collector
    trick applied)."""
    out = _proxy_help_then(
        "print('httpx' in sys.modules, sys.modules.get('httpx._main', 0) is None, 'rich' in sys.modules)"
    )
    assert out.strip().endswith("True True False"), out


def test_the_proxy_package_leaves_the_server_stack_to_its_main() -> None:
    """``python -m pytest_pdserve.proxy`` imports the package first: had it imported the app (httpx, starlette,
    uvicorn), ``__main__``'s no-collector block and the httpx stub would come too late, as they did until
    2026-12-03 (the collector test above passed all the same: something was still frozen)."""
    code = (
        "import sys, pytest_pdserve.proxy\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'httpx', 'starlette', 'uvicorn'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]", out
    from pytest_pdserve.proxy import ProxyConfig, prefill_body  # the public names still resolve, lazily

    assert callable(prefill_body)
    assert ProxyConfig.__module__ == "pytest_pdserve.proxy.app"


def test_an_httpx_that_needs_its_client_is_imported_whole(tmp_path: Path) -> None:
    fake = tmp_path / "httpx"
    fake.mkdir()
    (fake / "__init__.py").write_text("from ._main import main\nClient = object\n")  # no fallback, unlike 0.28
    (fake / "_main.py").write_text("def main():\n    return 'cli'\n")
    code = (
        "from pytest_pdserve.common.startup import import_httpx_without_its_cli\n"
        "import_httpx_without_its_cli()\n"
        "import httpx\n"
        f"print(httpx.__file__.startswith({str(tmp_path)!r}), httpx.main())"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True)
    assert out.stdout.split() == ["True", "cli"], out.stderr
