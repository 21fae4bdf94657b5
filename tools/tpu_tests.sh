#!/usr/bin/env bash
# The quick test suite (`-m "not slow"`) on the TPU, in one process, within 9 minutes:
#
#   bash tools/tpu_tests.sh --out DIR        (or OUT=DIR; default
#                                                  /tmp/solverkit-tpu-tests/)
#
# Tests that need float64 are skipped on a TPU, each with its reason (tests/conftest.py).
# Writes into DIR: junit.xml (every test, with failures' tracebacks), tests.log (the
# whole pytest output), summary.txt (device, versions, the pytest summary line, the
# failures and errors, the 15 slowest tests). pytest is cut at PYTEST_SECONDS (default
# 480); a cut run still leaves tests.log and summary.txt (junit.xml is written only by
# a run that ends). ALLOW_CPU=1 runs it without a TPU (to try it), PYTEST_ARGS adds
# pytest arguments (e.g. a file, or -k).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/solverkit-tpu-tests}"
[ "${1:-}" = "--out" ] && OUT="$2"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"
# shellcheck source=benchmarks/common.sh
. benchmarks/common.sh
bench_backend tpu_tests.sh tpu >/dev/null || exit 1

{
    echo "== device"
    "$PYTHON" -c "import jax, equinox, diffrax; print('jax', jax.__version__, \
'equinox', equinox.__version__, 'diffrax', diffrax.__version__, jax.devices())"
} > "$OUT/summary.txt" 2>&1

# One process: no xdist even where it is installed.
# shellcheck disable=SC2086  # PYTEST_ARGS is meant to split
timeout --signal=INT --kill-after=30 "${PYTEST_SECONDS:-480}" "$PYTHON" -m pytest -q \
    -m "not slow" -p no:cacheprovider -p no:xdist -rfE --durations=15 \
    --junitxml="$OUT/junit.xml" ${PYTEST_ARGS:-} > "$OUT/tests.log" 2>&1
rc=$?
{
    echo "== pytest exit status $rc (124 or 130: cut at ${PYTEST_SECONDS:-480} s)"
    echo "== summary"
    grep -E "^(FAILED|ERROR) " "$OUT/tests.log" || echo "(no failures or errors listed)"
    grep -E "slowest|^[0-9.]+s (call|setup|teardown)" "$OUT/tests.log" | head -16
    tail -1 "$OUT/tests.log"
} >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit "$rc"
