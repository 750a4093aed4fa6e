#!/usr/bin/env bash
# The project's static checks, exactly as .pre-commit-config.yaml and `tox -e lint` run them: ruff check,
# ruff format --check, mypy (strict; files and flags in pyproject's [tool.mypy]). Versions are the venv's, which
# pyproject's `test` extra installs, so a hook, tox and CI cannot disagree on the rules.
#
# Usage: scripts/lint.sh     PYTHON: the venv's interpreter (default <repo>/.venv/bin/python)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-.venv/bin/python}
status=0
"$PYTHON" -m ruff check pytest_pdserve tests || status=1
"$PYTHON" -m ruff format --check pytest_pdserve tests || status=1
"$PYTHON" -m mypy || status=1
exit $status
