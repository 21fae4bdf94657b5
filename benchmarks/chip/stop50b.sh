#!/usr/bin/env bash
# Stop 50, chip run B (#38): the vmap path with a small 1-D state carried as its
# components (solverkit/_split.py at 49f5cbd, not taken: reverted in 1e04cd0): the layout experiment at two sizes
# (benchmarks.vmap_layout: the array form against components, the loops' kernels),
# the Lorenz and Lotka-Volterra steps of the accelerator suite (steps 1, 2, 4: rows
# with single-shot first calls), and the first calls of the vmap path repeated.
# Usage on the device: bash benchmarks/chip/stop50b.sh "$OUT"
set -u
out="$1/b"; mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ ACCEL_STEPS=1,2,4 timeout 280 bash benchmarks/accel.sh --out "$out/accel"
  echo "== accel.sh steps 1,2,4 exit $? after $SECONDS s"
  timeout --signal=INT --kill-after=20 200 python3 -m benchmarks.first_call \
    --dtype float32 --repeats 2 --peers solverkit,diffrax --out "$out/first_call" \
    --only lorenz/adaptive-forward,lorenz/fixed-forward,lorenz/adaptive-grad,lorenz/fixed-grad,lotka_volterra/forward,lotka_volterra/grad-backsolve
  echo "== first_call exit $? after $SECONDS s"; } > "$out/run.log" 2>&1
