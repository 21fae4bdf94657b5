#!/usr/bin/env bash
# Stop 51, chip run C (#38): the gradients' first calls after the vmap rule stopped
# wrapping a solve that is seen differentiated (LV's rose 0.5-1 s in runs A and B):
# the suite's steps 2 (Lorenz fixed-step gradient, 4096) and 4 (Lotka-Volterra), then
# LV's checkpointed gradient's first call repeated (`benchmarks.first_call`).
# Usage on the device: bash benchmarks/chip/stop51c.sh "$OUT"
set -u
out="$1/c"; mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ ACCEL_STEPS=2,4 ACCEL_SECONDS=150 timeout 170 bash benchmarks/accel.sh --out "$out/accel"
  echo "== accel.sh steps 2,4 exit $? after $SECONDS s"
  timeout --signal=INT --kill-after=20 120 python3 -m benchmarks.first_call \
    --dtype float32 --repeats 2 --only lotka_volterra/grad-checkpoint \
    --peers solverkit,diffrax --out "$out/first_call"
  echo "== first_call exit $? after $SECONDS s"; } > "$out/run.log" 2>&1
