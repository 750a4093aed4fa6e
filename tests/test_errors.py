"""One exception family, in one module: every exception class of pytest_pdserve lives in errors.py.

The walk reads the package's source (ast, nothing imported), so a class defined anywhere else fails here
whatever it derives from, directly or through another class of the package.
"""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path

import pytest
from _package_classes import exception_classes

from pytest_pdserve import errors

#: Where an exception class may be defined outside errors.py, and why (errors.py's docstring says the same).
ALLOWED_ELSEWHERE = {
    # The simulator is a separate process standing in for vLLM: its exceptions carry vLLM's names and become HTTP
    # error bodies or an exit status, never an exception in the test process.
    "sim/": "the simulator's own (vLLM's names, never cross into the test process)",
    # Runs by path as a script in the vLLM venv, where pytest_pdserve cannot be imported.
    "engines/tiny_model.py:TinyModelError": "tiny_model.py imports nothing from pytest_pdserve",
}


def _allowed(path: str, name: str) -> bool:
    return path.startswith("sim/") or f"{path}:{name}" in ALLOWED_ELSEWHERE


def test_every_exception_class_is_defined_in_errors_py() -> None:
    found = exception_classes()
    assert {("errors.py", "PDServeError"), ("errors.py", "SettingError")} <= found.keys()  # the walk sees them
    elsewhere = sorted(f"{path}:{name}({', '.join(bases)})" for (path, name), bases in found.items()
                       if path != "errors.py" and not _allowed(path, name))  # fmt: skip
    assert not elsewhere, f"exception classes outside pytest_pdserve/errors.py: {elsewhere}"


def test_the_walk_finds_an_exception_defined_elsewhere(tmp_path: Path) -> None:
    """The check itself: a module defining ``class X(SettingError)`` (indirect) or ``class Y(OSError)`` is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "errors.py").write_text("class PDServeError(Exception): ...\nclass SettingError(PDServeError): ...\n")
    (pkg / "other.py").write_text("class X(SettingError): ...\nclass Y(OSError): ...\nclass Z: ...\n")
    assert {k for k in exception_classes(pkg) if k[0] == "other.py"} == {("other.py", "X"), ("other.py", "Y")}


def _family() -> list[type[BaseException]]:
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, BaseException)]


def test_one_family_under_pdserve_error() -> None:
    family = _family()
    assert len(family) >= 27
    assert [c.__name__ for c in family if not issubclass(c, errors.PDServeError)] == []
    assert sorted(c.__name__ for c in family) == sorted(n for n in errors.__all__ if n[0].isupper())


@pytest.mark.parametrize(
    ("cls", "base"),
    [
        (errors.SettingError, ValueError),
        (errors.ExtraArgsError, ValueError),
        (errors.InventoryError, ValueError),
        (errors.MarkerError, ValueError),
        (errors.ClusterSpecError, ValueError),
        (errors.MetricNotFoundError, LookupError),
        (errors.MetricsScrapeError, RuntimeError),
        (errors.MetricsSettleTimeout, TimeoutError),
        (errors.PrefixCacheHeld, AssertionError),
        (errors.RequestFailed, AssertionError),
        (errors.EffectiveConfigError, errors.ServerStartupError),
        (errors.NotPDReady, errors.ServerStartupError),
    ],
)
def test_a_moved_class_keeps_its_standard_base(cls: type[BaseException], base: type[BaseException]) -> None:
    """``except ValueError`` / ``pytest.raises(TimeoutError)`` written against the old homes still catch them, and
    the request helpers' failures stay AssertionErrors, so pytest reports a failed test."""
    assert issubclass(cls, base)
    assert issubclass(cls, errors.PDServeError)


def test_the_old_public_import_paths_still_work() -> None:
    from pytest_pdserve import clients, metrics

    assert metrics.MetricNotFoundError is errors.MetricNotFoundError
    assert metrics.MetricsScrapeError is errors.MetricsScrapeError
    assert metrics.MetricsSettleTimeout is errors.MetricsSettleTimeout
    assert clients.PrefixCacheHeld is errors.PrefixCacheHeld


def test_a_moved_class_is_redacted_and_pickles() -> None:
    from pytest_pdserve.common.redaction import register
    from pytest_pdserve.running.verify import Mismatch

    secret = f"sk-moved-{uuid.uuid4().hex[:8]}"
    register(secret)
    for exc in (
        errors.SettingError(f"bad value key={secret}"),
        errors.MetricsSettleTimeout(f"kept changing {secret}"),
        errors.PrefixCacheHeld(f"held {secret}"),
        errors.RequestFailed(f"decode-0 -> 500: {secret}", 500),
        errors.EffectiveConfigError([Mismatch("decode-0", "served model", "m", secret, "/v1/models")], "/tmp/x.log"),
    ):
        assert secret not in str(exc), type(exc).__name__
        assert secret not in repr(exc), type(exc).__name__
        again = pickle.loads(pickle.dumps(exc))
        assert (type(again), str(again)) == (type(exc), str(exc))
    assert pickle.loads(pickle.dumps(errors.RequestFailed("x", 503))).status == 503
