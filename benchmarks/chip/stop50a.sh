#!/usr/bin/env bash
# Stop 50, chip run A (#38): the Lotka-Volterra step of the accelerator suite (rows
# with single-shot first calls) and the backsolve gradient's first call repeated,
# after `ensemble_solve` with `BacksolveAdjoint` stopped compiling the kernel's
# forward sensitivities (its backward pass is now the lane loop's backsolve).
# Usage on the device: bash benchmarks/chip/stop50a.sh "$OUT"
set -u
out="$1/a"; mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ ACCEL_STEPS=4 timeout 150 bash benchmarks/accel.sh --out "$out/accel"
  echo "== accel.sh step 4 exit $? after $SECONDS s"
  timeout --signal=INT --kill-after=20 200 python3 -m benchmarks.first_call \
    --dtype float32 --repeats 2 --only lotka_volterra/grad-backsolve \
    --peers solverkit,solverkit-ensemble,diffrax --out "$out/first_call"
  echo "== first_call exit $? after $SECONDS s"; } > "$out/run.log" 2>&1
