#!/usr/bin/env bash
# The README's test command: set up a venv (pinned torch CPU wheel), lint, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q -c constraints.txt -e '.[test,report]'
ruff check .
python -m pytest -q -p no:cacheprovider "$@"
