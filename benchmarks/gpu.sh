#!/usr/bin/env bash
# The whole GPU benchmark suite in one command, in under 8 minutes on one H200.
#
#   bash benchmarks/gpu.sh [more `python -m benchmarks` flags]
#
# Writes benchmarks/results/<device-kind>/ (results.json, results.md, one PNG per
# case). Every case runs its GPU sizes (README) smallest and largest first, then the
# middle ones; each case has a time limit (--deadline) after which its remaining
# sizes are recorded as skipped, and a size that takes over --budget seconds skips
# the larger sizes of its series. No network is needed: if diffrax, equinox,
# matplotlib or tqdm are missing, wheels are installed from $WHEELS (default .whl/).
# PYTHON picks the interpreter (default python3); ALLOW_CPU=1 runs without a GPU
# (to try the script out).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"

if ! "$PYTHON" -c "import jax, equinox, diffrax, matplotlib, tqdm" 2>/dev/null; then
    if [ -d "$WHEELS" ]; then
        echo "gpu.sh: installing missing packages from $WHEELS" >&2
        "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" \
            equinox diffrax matplotlib tqdm
    fi
    "$PYTHON" -c "import jax, equinox, diffrax, matplotlib, tqdm" || {
        echo "gpu.sh: needs jax, equinox, diffrax, matplotlib and tqdm" >&2
        exit 1
    }
fi
if [ -d "$WHEELS" ] && ! "$PYTHON" -c "import gradsolve" 2>/dev/null; then
    "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" gradsolve \
        2>/dev/null || echo "gpu.sh: gradsolve not installed; it will be skipped" >&2
fi

backend=$("$PYTHON" -c "import jax; print(jax.default_backend())")
if [ "$backend" != "gpu" ] && [ "${ALLOW_CPU:-0}" != "1" ]; then
    echo "gpu.sh: JAX sees no GPU (backend: $backend); set ALLOW_CPU=1 to run anyway" >&2
    exit 1
fi
"$PYTHON" -c "import jax; print('gpu.sh: jax', jax.__version__, jax.devices())" >&2

# 3 cases x deadline + the last task of each + start-up stays under 8 minutes; the
# timeout is a backstop (results are written after every case). Gradients stop at
# N = 2^22: the Lorenz gradient keeps about 16 KiB of checkpoints per trajectory
# (15.6 MiB at N = 1024 on CPU), so 2^24 would need about 256 GiB.
exec timeout --signal=INT 470 "$PYTHON" -m benchmarks \
    --cases lorenz,lotka_volterra,neural_ode \
    --deadline lorenz=170,lotka_volterra=100,neural_ode=80 \
    --grad-max-size 4194304 --budget 30 --repeats 5 "$@"
