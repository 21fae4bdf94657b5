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
#
# After the suite, the lane-refill ensemble benchmark (`benchmarks.ensemble`: Lorenz
# and Van der Pol ensembles, N = 4096 and 65,536, lane refill against lockstep vmap
# and diffrax) and the events benchmark (`benchmarks.events`, N = 4096) run, each
# under its own time limit, their tables written beside the suite's results
# (ensemble.md, events.json; rows are written as they finish, so a cut run keeps
# what it had). GPU_EXTRAS=0 skips them; ENSEMBLE_ARGS / EVENTS_ARGS replace their
# flags (e.g. ENSEMBLE_ARGS="--sizes 256 --repeats 1 --cases lorenz100" to try it
# on a CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/common.sh
. benchmarks/common.sh
bench_packages
bench_backend gpu.sh gpu >/dev/null
"$PYTHON" -c "import jax; print('gpu.sh: jax', jax.__version__, jax.devices())" >&2

# 3 cases x deadline + the last task of each + start-up, then the ensemble (150 s)
# and events (80 s) benchmarks, stay under 8 minutes; each timeout is a backstop
# (results are written after every case, rows as they finish). Gradients stop at
# N = 2^22: the Lorenz gradient keeps about 16 KiB of checkpoints per trajectory
# (15.6 MiB at N = 1024 on CPU), so 2^24 would need about 256 GiB.
out=$(bench_out "$@")
rc=0
timeout --signal=INT 250 "$PYTHON" -m benchmarks \
    --cases lorenz,lotka_volterra,neural_ode \
    --deadline lorenz=90,lotka_volterra=55,neural_ode=40 \
    --grad-max-size 4194304 --budget 30 --repeats 5 "$@" || rc=$?
[ "${GPU_EXTRAS:-1}" = "1" ] || exit "$rc"
mkdir -p "$out"
echo "gpu.sh: ensemble benchmark -> $out/ensemble.md" >&2
# shellcheck disable=SC2086  # the flags are meant to split
bench_module 150 ensemble ${ENSEMBLE_ARGS:---sizes 4096,65536 --lanes d,4096 --repeats 3} \
    | tee "$out/ensemble.md" || rc=$?
echo "gpu.sh: events benchmark -> $out/events.json" >&2
# shellcheck disable=SC2086
bench_module 80 events ${EVENTS_ARGS:---size 4096 --repeats 3} \
    --json "$out/events.json" || rc=$?
exit "$rc"
