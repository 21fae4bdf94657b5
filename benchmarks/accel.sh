#!/usr/bin/env bash
# The whole benchmark suite on whatever accelerator JAX sees (TPU or GPU), in one
# command, inside 9.5 minutes on one TPU v5e (the step limits below come from
# the steps' times on that chip, which each step's log line reports):
#
#   bash benchmarks/accel.sh [more `python -m benchmarks` flags, e.g. --out DIR]
#
# Writes benchmarks/results/<device-kind>/ (e.g. tpu-v5-lite/): results.json,
# results.md, ensemble.md, stiff_ensemble.md, events.json, and one PNG per case
# where matplotlib is installed (it is not installed for the run, see MPL_INDEX:
# `python -m benchmarks.report DIR` draws them afterwards from results.json). On a TPU everything runs in float32 (float64 is
# emulated there, and diffrax's float64 solves fail); DTYPE=float32 forces it
# elsewhere. Each step runs in its own process under its own time limit, so a crash
# or an out-of-memory in one loses that step's unfinished rows only (the suite
# records a peer's failure as a row: status `oom` or `error`/`unsupported`, with
# the message); results are written as rows finish. The steps:
#
#   1. Lorenz (DiffEqGPU's ensemble) at N = 4096 and 65,536: adaptive (float32: PID
#      rtol = atol = 1e-5) forward and gradient, fixed-step forward; 2. its
#      fixed-step gradient at 4096; 3. at 2^20: the gradients (memory: fixed-step,
#      then adaptive), then the adaptive forward and the rest as time allows;
#   4. Lotka-Volterra, N = 4096: forward and the gradient with each adjoint;
#   5. benchmarks.kernel (the whole-solve Pallas kernel against the vmapped loop;
#      skipped if absent), 6. benchmarks.ensemble (`ensemble_solve`'s defaults
#      against lockstep `jax.vmap`), 7. benchmarks.stiff_ensemble (VdP, N = 16,384:
#      Rodas5P vmapped and through `ensemble_solve`, Kvaerno5, BDF),
#      8. benchmarks.events (N = 1024, forward); 9. the neural ODE, N = 256 and 4096,
#      only when asked for (ACCEL_STEPS=9: it does not fit the 10 minutes).
#
# Steps 1-3 run solverkit twice, as `jax.vmap(diffeqsolve)` (`solverkit`) and
# through its ensemble API, `ensemble_solve(kernel=None)` (`solverkit-ensemble`: the
# whole-solve kernel where it supports the solve, the lane loop elsewhere; its rows
# name the path), beside diffrax (`jax.vmap(diffeqsolve)`), each row
# with its ratio to diffrax's.
#
# Every solverkit and diffrax solve runs with `--throw false`, both libraries alike:
# a jitted solve with throw=True carries a run-time error check, a host callback
# that costs about 2 ms a call on a TPU whichever library it is (kernel_profile: a
# jitted `y0 * 2` 0.58 ms, with a never-firing check 2.50 ms), which would hide the
# solvers' own times at N = 4096. The table measures the solvers; a failed
# trajectory shows in its error column. (An eager solverkit call, outside jit, has
# no callback at all: it checks on the host.) Pass `--throw true` to time the
# check too.
#
# ACCEL_SECONDS (default 545) is the whole run's budget: each step's limit is cut
# to what is left. A run that takes over 1 s is timed once (`--repeat-budget 1`:
# on the chip such runs repeated to within 0.3%), shorter ones twice. KERNEL_ARGS,
# ENSEMBLE_ARGS, STIFF_ARGS, EVENTS_ARGS replace those modules' flags; extra
# arguments go to every `python -m benchmarks` step (sizes: LORENZ_SIZES,
# LORENZ_BIG, LV_SIZE, NODE_SIZES, not --sizes). Try it on a CPU with tiny sizes
# (the 545 s budget; on 2 loaded cores the step limits cut rows, which are kept):
#
#   ALLOW_CPU=1 DTYPE=float32 KERNEL_ARGS="--sizes 256 --repeats 1 --methods vmap" \
#       ENSEMBLE_ARGS="--sizes 256 --repeats 1" EVENTS_ARGS="--quick" \
#       STIFF_ARGS="--plan rodas5p-vmap:16:1e-5 --repeats 1" \
#       LORENZ_SIZES=16,64 LORENZ_BIG=256 LV_SIZE=16 NODE_SIZES=16 \
#       bash benchmarks/accel.sh --repeats 1 \
#       --peers solverkit,solverkit-ensemble,diffrax --out /tmp/accel-try
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# No matplotlib is installed for the run (pip and the plots cost the budget): draw
# the plots afterwards with `python -m benchmarks.report OUT` anywhere, or set
# MPL_INDEX (e.g. file:///opt/pypi/simple, a local index) to install it first.
MPL_INDEX="${MPL_INDEX:-}"
# shellcheck source=benchmarks/common.sh
. benchmarks/common.sh
bench_packages || exit 1
backend=$(bench_backend accel.sh tpu gpu) || exit 1
if [ "$backend" = "tpu" ]; then DTYPE="${DTYPE:-float32}"; fi
dtype_flag=()
[ -n "${DTYPE:-}" ] && dtype_flag=(--dtype "$DTYPE")
out=$(bench_out "$@")
mkdir -p "$out"
budget="${ACCEL_SECONDS:-545}"
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
    # A limit cut by the budget cuts the deadline alike (the rows' end, then the
    # tables and plots, ~15 s): the step still ends by itself.
    [ $((seconds - $1 + deadline)) -lt "$deadline" ] && deadline=$((seconds - $1 + deadline))
    [ "$deadline" -lt 1 ] && deadline=1
    shift 2
    echo "accel.sh: benchmarks $* (deadline ${deadline} s, limit ${seconds} s)" >&2
    timeout --signal=INT --kill-after=20 "$seconds" "$PYTHON" -m benchmarks \
        --deadline "$deadline" --budget 40 --repeats 2 --repeat-budget 1 \
        --throw false ${dtype_flag[@]+"${dtype_flag[@]}"} "$@" \
        || { echo "accel.sh: step exited with $?" >&2; rc=1; }
}

# ended N START: say when step N (begun at START s) ended.
ended() { echo "accel.sh: step $1 ended after $((SECONDS - $2)) s (${SECONDS} s in all)" >&2; }

# Step limits (PLANNED DEADLINE) from the chip's costs (first call + runs, as each
# step's log line reports them; each step's process start-up and exit ~10 s): at
# N = 4096 and 65,536 the adaptive variants and the fixed-step forward take ~85 s
# for solverkit, solverkit-ensemble and diffrax; the fixed-step gradient at 4096
# ~25 s (at 65,536 diffrax's alone takes ~41 s, 15.7 s a run: left out); at 2^20 the fixed-step gradient (the memory
# measurement) goes first, then the adaptive one, then the adaptive forward
# (diffrax's ~17 s; its first call 14 s and runs of 2.4 s: started just before the
# deadline it ends ~40 s later with the step's exit, so the limit is 100 s: at 85 s
# a run whose adaptive gradient ran out of memory had step 3 cut after its last
# row). A deadline
# leaves out the last rows of a step (recorded as skipped) so that each step ends
# by itself inside its limit; a row cut by the limit itself is lost. The first step
# writes afresh, the others --append. The peers are solverkit (`jax.vmap`), its
# ensemble API and diffrax (ACCEL_PEERS; gradsolve, float32 in its fixed-step rows
# only, costs ~10 s of first calls: ACCEL_PEERS=solverkit,solverkit-ensemble,diffrax,gradsolve).
# ACCEL_STEPS (default 1-8 and 10; e.g. 2,3,6) runs only those of the ten steps
# (numbered as above). Each step's end is logged with the seconds it took.
want() { [[ ",${ACCEL_STEPS:-1,2,3,4,5,6,7,8,10}," == *",$1,"* ]] && start=$SECONDS; }
peers=(--peers "${ACCEL_PEERS:-solverkit,solverkit-ensemble,diffrax}")
lorenz_sizes="${LORENZ_SIZES:-4096,65536}"
if want 1; then
    suite 115 95 "${peers[@]}" --cases lorenz --sizes "$lorenz_sizes" \
        --variants adaptive-forward,adaptive-grad,fixed-forward "$@"
    ended 1 "$start"
fi
if want 2; then
    suite 50 25 "${peers[@]}" --cases lorenz --sizes "${lorenz_sizes%%,*}" \
        --variants fixed-grad --append "$@"
    ended 2 "$start"
fi
if want 3; then
    suite 100 60 "${peers[@]}" --cases lorenz --sizes "${LORENZ_BIG:-1048576}" \
        --variants fixed-grad,adaptive-grad,adaptive-forward,fixed-forward \
        --grad-max-size 1048576 --append "$@"
    ended 3 "$start"
fi
if want 4; then
    suite 70 45 "${peers[@]}" --cases lotka_volterra --sizes "${LV_SIZE:-4096}" --append "$@"
    ended 4 "$start"
fi

# The kernel against the vmapped loop at one size, with steps and time per step;
# its rows beside diffrax are steps 1-3's solverkit-ensemble.
# shellcheck disable=SC2086  # the flags are meant to split
if want 5; then
    bench_module "$(limit 25)" kernel ${KERNEL_ARGS:---sizes 65536 \
        --methods kernel,vmap --cases lorenz --repeats 2} \
        ${dtype_flag[@]+"${dtype_flag[@]}"} --out "$out/kernel" || rc=1
    ended 5 "$start"
fi
# `ensemble_solve` with every default (`--lanes k`: the whole-solve kernel where it
# supports the solve) against the lockstep `jax.vmap`, Lorenz rho <= 100 and 28,
# t <= 10 (the VdP sweep: the stiff step's rodas5p-ensemble row).
# shellcheck disable=SC2086
if want 6; then
    lim=$(limit 40)  # nothing starts after its limit less 20 s
    bench_module "$lim" ensemble --budget-s $((lim - 20)) ${ENSEMBLE_ARGS:---sizes 16384 \
        --lanes k --cases lorenz100,lorenz28 --no-chunked --repeats 2} \
        ${dtype_flag[@]+"${dtype_flag[@]}"} | tee "$out/ensemble.md" || rc=1
    ended 6 "$start"
fi
# Van der Pol, N = 16,384, each solver at the tolerance where it matched or beat
# diffrax's error on the chip (`python -m benchmarks.stiff_ensemble --plan chip`:
# Rodas5P 1e-6, Kvaerno5 1e-7; BDF at 1e-5, 5.3 s a run), each case in its own process under its
# own limit. diffrax's Kvaerno5 is left out: it did not finish in 40 s even at 1e-3
# (`STIFF_ARGS` with diffrax-kvaerno5:16384:1e-3:40 to see it again).
# shellcheck disable=SC2086
if want 7; then
    lim=$(limit 105)  # each case's limit cut to what is left of its limit less 15 s
    bench_module "$lim" stiff_ensemble --budget $((lim - 15)) ${STIFF_ARGS:---plan \
        rodas5p-vmap:16384:1e-6:25,rodas5p-ensemble:16384:1e-6:25,kvaerno5-vmap:16384:1e-7:25,bdf-vmap:16384:1e-5:30 \
        --repeats 1} \
        ${dtype_flag[@]+"${dtype_flag[@]}"} --out "$out/stiff_ensemble" | tee "$out/stiff_ensemble.md" || rc=1
    ended 7 "$start"
fi
# The spiking network's forward solve (its gradient's first calls, ~60 s with
# diffrax's, do not fit: `python -m benchmarks.events --dtype float32 --size 1024`).
# shellcheck disable=SC2086
if want 8; then
    bench_module "$(limit 45)" events ${EVENTS_ARGS:---size 1024 --repeats 2 --variants forward} \
        ${dtype_flag[@]+"${dtype_flag[@]}"} --json "$out/events.json" || rc=1
    ended 8 "$start"
fi
# The 2-64-64-2 neural ODE at N = 4096 and the latent size (32-256x3, N = 1024):
# forward, checkpointed gradient and BacksolveAdjoint against diffrax, with
# `throw=False` (`python -m benchmarks.neural_matrix --parts neural`; about 40 s for
# the first two rows on the chip, results/tpu-v5-lite/neural_matrix). It runs last
# and takes what is left of the budget.
if want 10; then
    bench_module "$(limit 90)" neural_matrix --parts neural --budget 60 \
        --out "$out/neural_matrix" || rc=1
    ended 10 "$start"
fi
# The neural ODE, not in the default plan: its first calls (three adjoints at two
# sizes, diffrax's among them) and its float64 reference (~35 s on the TPU host's
# CPU) take minutes, and the other steps are the accelerator issues' measurements.
# `ACCEL_STEPS=9 bash benchmarks/accel.sh --out DIR` runs it alone.
if want 9; then
    suite 300 240 "${peers[@]}" --cases neural_ode --sizes "${NODE_SIZES:-256,4096}" --append "$@"
    ended 9 "$start"
fi
echo "accel.sh: done in ${SECONDS} s; results in $out" >&2
exit "$rc"
