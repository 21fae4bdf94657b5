# Shared by gpu.sh and accel.sh (sourced, not run): checking the packages, the
# device, where the results go, and running one benchmark module under a time
# limit without stopping the suite when it fails.
# shellcheck shell=bash

PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"

# bench_packages: jax, equinox, diffrax and tqdm must import (installed from $WHEELS
# when missing and the folder exists); matplotlib is tried from $WHEELS, then from
# $MPL_INDEX (a local package index, into /tmp/mpl); without it the suite writes its
# tables and no plots. gradsolve is installed from $WHEELS when it can be.
bench_packages() {
    if ! "$PYTHON" -c "import jax, equinox, diffrax, tqdm" 2>/dev/null && [ -d "$WHEELS" ]; then
        echo "benchmarks: installing missing packages from $WHEELS" >&2
        "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" \
            equinox diffrax tqdm || true
    fi
    "$PYTHON" -c "import jax, equinox, diffrax, tqdm" || {
        echo "benchmarks: needs jax, equinox, diffrax and tqdm" >&2
        return 1
    }
    if ! "$PYTHON" -c "import matplotlib" 2>/dev/null; then
        if [ -d "$WHEELS" ]; then
            "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" \
                matplotlib 2>/dev/null || true
        fi
        if ! "$PYTHON" -c "import matplotlib" 2>/dev/null && [ -n "${MPL_INDEX:-}" ]; then
            "$PYTHON" -m pip install --quiet --isolated --only-binary=:all: \
                --index-url "$MPL_INDEX" --target /tmp/mpl matplotlib 2>/dev/null \
                && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/mpl"
        fi
        "$PYTHON" -c "import matplotlib" 2>/dev/null \
            || echo "benchmarks: no matplotlib; tables only, no plots" >&2
    fi
    if [ -d "$WHEELS" ] && ! "$PYTHON" -c "import gradsolve" 2>/dev/null; then
        "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" gradsolve \
            2>/dev/null || echo "benchmarks: gradsolve not installed; it will be skipped" >&2
    fi
    return 0
}

# bench_backend NAME WANT...: print JAX's backend; fail unless it is one of WANT
# (or ALLOW_CPU=1).
bench_backend() {
    local name="$1" backend
    shift
    # One process: JAX's version, devices and start-up time (stderr), and the process's
    # whole time with its exit (a TPU runtime's start and shutdown take seconds).
    local t0=$EPOCHREALTIME
    backend=$("$PYTHON" -c "import sys, time; import jax; t = time.perf_counter(); \
b = jax.default_backend(); print(b); print(f'$name: jax {jax.__version__} {jax.devices()}, \
backend up in {time.perf_counter() - t:.1f} s', file=sys.stderr)")
    echo "$name: that process took $(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $t0 }") s with its exit" >&2
    for want in "$@"; do
        [ "$backend" = "$want" ] && { echo "$backend"; return 0; }
    done
    if [ "${ALLOW_CPU:-0}" = "1" ]; then
        echo "$backend"
        return 0
    fi
    echo "$name: JAX sees no ${*} (backend: $backend); set ALLOW_CPU=1 to run anyway" >&2
    return 1
}

# bench_out ARGS...: the `--out` folder among the arguments, else the suite's
# default benchmarks/results/<device-kind>.
bench_out() {
    local out="" prev=""
    for arg in "$@"; do
        [ "$prev" = "--out" ] && out="$arg"
        case "$arg" in --out=*) out="${arg#--out=}" ;; esac
        prev="$arg"
    done
    if [ -z "$out" ]; then
        out="benchmarks/results/$("$PYTHON" -c \
            'from benchmarks.__main__ import device_slug; print(device_slug())')"
    fi
    echo "$out"
}

# bench_module SECONDS MODULE ARGS...: `python -m benchmarks.MODULE ARGS` under a
# time limit (SIGINT); skipped with a note when the module does not exist. Returns
# the command's status (124: cut by the limit); the caller goes on either way.
bench_module() {
    local seconds="$1" module="$2"
    shift 2
    if [ ! -f "benchmarks/$module.py" ]; then
        echo "benchmarks: benchmarks/$module.py absent; skipped" >&2
        return 0
    fi
    echo "benchmarks: $module $* (limit ${seconds} s)" >&2
    timeout --signal=INT --kill-after=20 "$seconds" "$PYTHON" -m "benchmarks.$module" "$@"
}
