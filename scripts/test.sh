#!/usr/bin/env bash
# The README's test command: set up a venv (pinned torch CPU wheel), lint, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q -c constraints.txt -e '.[test,report]'
# tests/e2e/test_slurm_e2e.py runs a real Slurm cluster (Debian's 22.05). Installed here
# when missing and root; otherwise those tests fail naming this command.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
    ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null ||
            { apt-get update -q >/dev/null && apt-get install -y -q slurmctld slurmd slurm-client munge >/dev/null; }
    else
        echo "Slurm missing: tests/e2e/test_slurm_e2e.py will fail;" \
            "run: sudo apt-get install -y slurmctld slurmd slurm-client munge" >&2
    fi
fi
ruff check .
python -m pytest -q -p no:cacheprovider --durations=40 "$@"
