#!/usr/bin/env bash
# The README's test command: set up a venv (pinned torch CPU wheel), lint, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
# The interpreter of a new .venv: $PYTHON if set, else the distribution's /usr/bin/python3
# (3.10+ with venv), else python3 on PATH. Debian's build (profile-guided, statically linked)
# runs this suite with about 12 % less CPU than a default pyenv build of the same 3.11
# (measured: BENCHMARKS.md, "The test command"). An existing .venv is kept as it is.
if [ ! -x .venv/bin/python ]; then
    for PY in ${PYTHON:-/usr/bin/python3 python3}; do
        command -v "$PY" >/dev/null 2>&1 || continue
        "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || continue
        "$PY" -m venv .venv 2>/dev/null && break
        rm -rf .venv
    done
    [ -x .venv/bin/python ] || { echo "no Python 3.10+ with venv found (set PYTHON=...)" >&2; exit 1; }
    echo "tests: .venv made with $PY ($(.venv/bin/python -c 'import sys; print(sys.version.split()[0])'))"
fi
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
PYTEST=(python -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ] || [ "${TEST_SPLIT:-1}" = 0 ]; then
    "${PYTEST[@]}" --durations=40 "$@"  # arguments given (or TEST_SPLIT=0): one process
    exit
fi
# Two pytest processes side by side (~2/3 of the time is the e2e scenarios, which mostly
# wait on timeouts, detection and process starts): A runs these e2e files, B the other
# e2e files and every other test; the network-namespace scenarios go with A to even out the halves.
# A's output follows B's. elastic, warmstart and startup share the session's uninterrupted
# reference run, so they stay together.
A=(tests/e2e/test_elastic_e2e.py tests/e2e/test_warmstart_e2e.py tests/e2e/test_slurm_e2e.py
    tests/e2e/test_retention_e2e.py tests/e2e/test_quarantine_e2e.py tests/e2e/test_dropout_e2e.py
    tests/e2e/test_startup_e2e.py tests/e2e/test_netns_e2e.py tests/e2e/test_lightning_e2e.py
    tests/e2e/test_hf_trainer_e2e.py)
log=$(mktemp "${TMPDIR:-/tmp}/tests-a.XXXXXX")
set -m  # A in its own process group: an interrupt reaches it through the trap below
"${PYTEST[@]}" --durations=20 "${A[@]}" >"$log" 2>&1 &
a=$!
set +m
trap 'kill -INT -- "-$a" 2>/dev/null; wait "$a"; cat "$log"; exit 130' INT TERM
echo "tests: process A (${A[*]}) runs beside this one, its output in $log, shown after B's"
echo "== B: every other test"
b_rc=0
"${PYTEST[@]}" --durations=20 "${A[@]/#/--ignore=}" || b_rc=$?
echo "== A: ${A[*]} (output so far, then as it comes)"
tail -n +1 --pid="$a" -f "$log"
a_rc=0
wait "$a" || a_rc=$?
trap - INT TERM
rm -f "$log"
echo "tests: A exit $a_rc, B exit $b_rc"
[ "$a_rc" -eq 0 ] && [ "$b_rc" -eq 0 ]
