#!/usr/bin/env bash
# The whole benchmark suite on whatever accelerator JAX sees (TPU or GPU), in one
# command, inside 9.5 minutes on one TPU v5e (the step limits below
# come from the run in benchmarks/results/tpu-v5-lite/accel/):
#
#   bash benchmarks/accel.sh [more `python -m benchmarks` flags, e.g. --out DIR]
#
# Writes benchmarks/results/<device-kind>/ (e.g. tpu-v5-lite/): results.json,
# results.md and one PNG per case (no PNGs without matplotlib), ensemble.md,
# stiff_ensemble.md, events.json. On a TPU everything runs in float32 (float64 is
# emulated there, and diffrax's float64 solves fail); DTYPE=float32 forces it
# elsewhere. Each step runs in its own process under its own time limit, so a crash
# or an out-of-memory in one loses that step's unfinished rows only (the suite
# records a peer's failure as a row: status `oom` or `error`/`unsupported`, with
# the message); results are written as rows finish. The steps:
#
#   1. Lorenz (DiffEqGPU's ensemble): N = 4096, 65,536, 2^20; fixed-step and
#      adaptive (float32: PID rtol = atol = 1e-5), forward and gradient;
#   2. Lotka-Volterra, N = 4096: forward and the gradient with each adjoint;
#   3. benchmarks.kernel (the whole-solve Pallas kernel against the vmap path and
#      diffrax; skipped if absent), 4. benchmarks.ensemble (lane refill),
#   5. benchmarks.stiff_ensemble, 6. benchmarks.events (N = 4096),
#   7. the neural ODE, N = 256 and 4096 (gradients).
#
# ACCEL_SECONDS (default 540) is the whole run's budget: each step's limit is cut
# to what is left. KERNEL_ARGS, KERNEL_BIG_ARGS, ENSEMBLE_ARGS, STIFF_ARGS, EVENTS_ARGS replace those modules'
# flags; extra arguments go to every `python -m benchmarks` step. Try it on a CPU
# with tiny sizes (a few minutes on 2 shared cores):
#
#   ALLOW_CPU=1 DTYPE=float32 ENSEMBLE_ARGS="--sizes 256 --repeats 1" \
#       STIFF_ARGS="--quick" EVENTS_ARGS="--quick" \
#       bash benchmarks/accel.sh --sizes 16 --repeats 1 --peers solverkit,diffrax \
#       --out /tmp/accel-try
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
MPL_INDEX="${MPL_INDEX:-file:///opt/pypi/simple}"
# shellcheck source=benchmarks/common.sh
. benchmarks/common.sh
bench_packages || exit 1
backend=$(bench_backend accel.sh tpu gpu) || exit 1
"$PYTHON" -c "import jax; print('accel.sh: jax', jax.__version__, jax.devices())" >&2
if [ "$backend" = "tpu" ]; then DTYPE="${DTYPE:-float32}"; fi
dtype_flag=()
[ -n "${DTYPE:-}" ] && dtype_flag=(--dtype "$DTYPE")
out=$(bench_out "$@")
mkdir -p "$out"
budget="${ACCEL_SECONDS:-540}"
rc=0

# limit PLANNED: PLANNED seconds, or what is left of the budget if less (>= 10).
limit() {
    local left=$((budget - SECONDS))
    [ "$left" -lt "$1" ] && { [ "$left" -gt 10 ] && echo "$left" || echo 10; return; }
    echo "$1"
}

# suite PLANNED_S DEADLINE_S ARGS...: one `python -m benchmarks` step.
suite() {
    local seconds deadline="$2"
    seconds=$(limit "$1")
    shift 2
    echo "accel.sh: benchmarks $* (deadline ${deadline} s, limit ${seconds} s)" >&2
    timeout --signal=INT --kill-after=20 "$seconds" "$PYTHON" -m benchmarks \
        --deadline "$deadline" --budget 40 --repeats 2 ${dtype_flag[@]+"${dtype_flag[@]}"} "$@" \
        || { echo "accel.sh: step exited with $?" >&2; rc=1; }
}

# Gradients up to 2^20 (the fixed-step checkpointed gradient's memory: see
# docs/benchmarks.md); the first step writes afresh, the others --append.
suite 175 150 --cases lorenz --sizes 4096,65536,1048576 \
    --variants fixed-forward,fixed-grad,adaptive-forward,adaptive-grad \
    --grad-max-size 1048576 "$@"
suite 70 50 --cases lotka_volterra --sizes 4096 --append "$@"

# shellcheck disable=SC2086  # the flags are meant to split
bench_module "$(limit 50)" kernel ${KERNEL_ARGS:---sizes 4096,65536 \
    --methods kernel,vmap,diffrax --cases lorenz --repeats 2} \
    ${dtype_flag[@]+"${dtype_flag[@]}"} --out "$out/kernel" || rc=1
# 2^20 without diffrax (its 2^20 row is in step 1's table).
# shellcheck disable=SC2086
bench_module "$(limit 30)" kernel ${KERNEL_BIG_ARGS:---sizes 1048576 \
    --methods kernel,vmap --cases lorenz --repeats 2} \
    ${dtype_flag[@]+"${dtype_flag[@]}"} --out "$out/kernel-2p20" || rc=1
# shellcheck disable=SC2086
bench_module "$(limit 40)" ensemble ${ENSEMBLE_ARGS:---sizes 16384 --repeats 2} \
    ${dtype_flag[@]+"${dtype_flag[@]}"} | tee "$out/ensemble.md" || rc=1
# shellcheck disable=SC2086
bench_module "$(limit 90)" stiff_ensemble ${STIFF_ARGS:---sizes 16384 --repeats 2 --case-timeout 30} \
    ${dtype_flag[@]+"${dtype_flag[@]}"} | tee "$out/stiff_ensemble.md" || rc=1
# shellcheck disable=SC2086
bench_module "$(limit 50)" events ${EVENTS_ARGS:---size 1024 --repeats 2} \
    ${dtype_flag[@]+"${dtype_flag[@]}"} --json "$out/events.json" || rc=1
# The neural ODE last: the other steps are the accelerator issues' measurements.
suite 40 30 --cases neural_ode --sizes 256,4096 --append "$@"
echo "accel.sh: done in ${SECONDS} s; results in $out" >&2
exit "$rc"
