#!/usr/bin/env bash
# Build the package as a maintainer would publish it and prove the wheel works on its own (issue 29):
#
#   1. `python -m build`: the sdist, then the wheel built from that sdist (so a file the sdist leaves out breaks
#      the wheel here, not on a user's machine), into a temporary directory;
#   2. `twine check --strict` on both (metadata, README rendering);
#   3. the wheel's contents: every file of pytest_pdserve/ in the checkout (py.typed, the simulator, the proxy, the
#      assertions), the LICENSE, nothing from tests/; its metadata: License-Expression, the project URLs, the
#      vllm-tests extra, classifiers that are on the trove list; the sdist has no tests/ either;
#   4. the wheel (not the checkout) installed into a clean venv, and the example suite run from that venv on the
#      simulator, from a directory where the checkout's pytest_pdserve cannot be imported; one more test in that
#      session fails unless the imported pytest_pdserve is the one inside the clean venv.
#
# Usage: scripts/check-package.sh     PYTHON: an interpreter with build, twine and trove-classifiers (the `test`
#                                     extra has them; default <repo>/.venv/bin/python). Needs the package index
#                                     (the build backend and the wheel's dependencies are installed from it).
# Prints one line per step with the seconds since start; exits non-zero at the first failed step.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-"$REPO_ROOT/.venv/bin/python"}
T0=$SECONDS
step() { echo "check-package: $* ($((SECONDS - T0)) s)"; }
die() { echo "check-package: ERROR: $*" >&2; exit 1; }

"$PYTHON" -c 'import build, twine, trove_classifiers' 2>/dev/null \
    || die "$PYTHON lacks build / twine / trove-classifiers: pip install -e '.[test]' (or set PYTHON)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-check-package-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# Nothing from the caller's environment may put the checkout on the clean venv's path.
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP PYTHONUSERBASE
export PYTHONNOUSERSITE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

"$PYTHON" -m build --outdir "$WORK/dist" "$REPO_ROOT" >"$WORK/build.log" 2>&1 \
    || { tail -40 "$WORK/build.log" >&2; die "python -m build failed (last lines above)"; }
WHEEL=$(ls "$WORK"/dist/*.whl)
SDIST=$(ls "$WORK"/dist/*.tar.gz)
step "built $(basename "$SDIST") ($(stat -c %s "$SDIST") bytes), $(basename "$WHEEL") ($(stat -c %s "$WHEEL") bytes)"

"$PYTHON" -m twine check --strict "$WORK"/dist/* >"$WORK/twine.log" 2>&1 \
    || { cat "$WORK/twine.log" >&2; die "twine check --strict failed"; }
step "twine check --strict passed"

"$PYTHON" - "$WHEEL" "$SDIST" "$REPO_ROOT" <<'EOF'
import email.parser, sys, tarfile, zipfile
from pathlib import Path
import trove_classifiers

wheel, sdist, root = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
problems = []
with zipfile.ZipFile(wheel) as zf:
    names = set(zf.namelist())
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
# Everything the plugin imports or reads at run time lives in pytest_pdserve/: the checkout's files are the list.
wanted = {
    p.relative_to(root).as_posix()
    for p in (root / "pytest_pdserve").rglob("*")
    if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
}
shipped = {n for n in names if n.startswith("pytest_pdserve/")}
for name in sorted(wanted - shipped):
    problems.append(f"wheel lacks {name}")
for name in sorted(shipped - wanted):
    problems.append(f"wheel has {name}, which the checkout's pytest_pdserve/ does not")
for name in sorted(n for n in names if not n.startswith(("pytest_pdserve/", meta_name.split("/")[0] + "/"))):
    problems.append(f"wheel has {name} outside the package (tests/ and the like belong to the repository)")
if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
    problems.append("wheel has no dist-info/licenses/LICENSE")
if meta.get("License-Expression") != "Apache-2.0":
    problems.append(f"License-Expression is {meta.get('License-Expression')!r}, not 'Apache-2.0'")
urls = {u.split(",", 1)[0].strip() for u in meta.get_all("Project-URL") or ()}
for label in ("Source", "Issues", "Changelog"):
    if label not in urls:
        problems.append(f"no Project-URL {label} (has {sorted(urls)})")
if "vllm-tests" not in (meta.get_all("Provides-Extra") or ()):
    problems.append("no vllm-tests extra")
for classifier in meta.get_all("Classifier") or ():
    if classifier not in trove_classifiers.classifiers:
        problems.append(f"classifier {classifier!r} is not on the trove list")
with tarfile.open(sdist) as tf:
    members = [m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name]
for name in ("LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml"):
    if name not in members:
        problems.append(f"sdist lacks {name}")
problems += [f"sdist has {m}" for m in members if m.startswith("tests/")][:5]
if problems:
    sys.exit("check-package: ERROR: " + "\ncheck-package: ERROR: ".join(problems))
print(f"check-package: wheel holds the {len(wanted)} files of pytest_pdserve/ and its LICENSE, nothing else;", end=" ")
print(f"{len(meta.get_all('Classifier') or ())} classifiers on the trove list")
EOF
step "wheel and sdist contents checked"

# A clean venv: the base interpreter's, no system site-packages, nothing but the wheel and its dependencies.
BASE_PYTHON=$("$PYTHON" -c 'import sys; print(sys._base_executable)')
"$BASE_PYTHON" -m venv "$WORK/venv"
VENV_PY="$WORK/venv/bin/python"
"$VENV_PY" -m pip install -q "$WHEEL" >"$WORK/install.log" 2>&1 \
    || { tail -20 "$WORK/install.log" >&2; die "pip install $(basename "$WHEEL") into a clean venv failed"; }
step "wheel installed into a clean venv"
"$WORK/venv/bin/pdserve" --help >/dev/null || die "the wheel's pdserve command does not run"
"$WORK/venv/bin/pdserve-sim" --help >/dev/null || die "the wheel's pdserve-sim command does not run"

# The example suite as the README runs it, from a directory outside the checkout (no pyproject, no conftest:
# the checkout's pytest_pdserve is on no path), plus the proof of where the plugin came from.
RUN="$WORK/run"
mkdir -p "$RUN"
cp -r "$REPO_ROOT/examples" "$RUN/examples"
find "$RUN/examples" -name __pycache__ -prune -exec rm -rf {} +
cat >"$RUN/test_installed_wheel.py" <<'EOF'
"""The session runs the wheel installed in the clean venv, not the checkout it was built from."""

import importlib.metadata
import sys
from pathlib import Path

import pytest_pdserve


def test_pytest_pdserve_is_the_clean_venvs(pytestconfig):
    venv = Path(sys.prefix).resolve()
    module = Path(pytest_pdserve.__file__).resolve()
    assert venv in module.parents, f"pytest_pdserve imported from {module}, not from the clean venv {venv}"
    plugin = pytestconfig.pluginmanager.get_plugin("pdserve")  # loaded through the wheel's pytest11 entry point
    assert plugin is not None and venv in Path(plugin.__file__).resolve().parents
    dist = importlib.metadata.distribution("pytest-pdserve")
    assert dist.read_text("direct_url.json") is None or '"editable": true' not in dist.read_text("direct_url.json")
    assert (module.parent / "py.typed").is_file()
EOF
(cd "$RUN" && PDSERVE_CACHE_DIR="$WORK/cache" "$WORK/venv/bin/pytest" -p no:cacheprovider -W error -ra \
    examples test_installed_wheel.py --pd-engine=sim --pd-lease-dir="$WORK/leases" --pd-log-dir="$WORK/logs") \
    || die "the example suite failed from the clean venv (above)"
step "example suite passed on the simulator from the clean venv"
